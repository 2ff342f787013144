"""Engine drivers as registered plugins: a new serving engine is one module in `engine_check/engines/`.

Each module of the catalog package defines `PLUGIN = EngineDriver(...)`: the name users pass to
`--engine`, the pip distribution that must be installed, what its check covers (`CheckCoverage`: the
engine's weight loaders ran, or only its config and name rules), its typed options (a pydantic model,
set with `--engine-option KEY=VALUE`) and the dotted path of the function that runs the check inside
the worker process. Nothing here imports an engine: the registry is read by `--help` and the parent
process, the engine is imported only by the check's child process.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from collections.abc import Callable
from dataclasses import dataclass, field

from pydantic import BaseModel

from ..plugins import Plugin, Registry
from .report import BuildDevice, CheckCoverage, EngineCheckReport

ENGINE_CATALOG = "kimi_nvfp4.engine_check.engines"


@dataclass(frozen=True)
class EngineDriver(Plugin):
    """One serving engine's check: `runner` is "module:function" taking (CheckpointView, BuildDevice, options)."""

    distribution: str = field(kw_only=True)
    coverage: CheckCoverage = field(kw_only=True)
    runner: str = field(kw_only=True)

    def installed(self) -> bool:
        """Whether the engine's distribution is installed (metadata only: importing an engine patches other
        libraries process-wide)."""
        try:
            importlib.metadata.version(self.distribution)
        except importlib.metadata.PackageNotFoundError:
            return False
        return True

    def run(self, view, device: BuildDevice, options: BaseModel) -> EngineCheckReport:
        module, _, function = self.runner.partition(":")
        check: Callable[..., EngineCheckReport] = getattr(importlib.import_module(module), function)
        report = check(view, device, options)
        report.coverage = self.coverage
        return report


ENGINES: Registry[EngineDriver] = Registry("engine", EngineDriver, catalog=ENGINE_CATALOG)
DEFAULT_ENGINE = "sglang"
