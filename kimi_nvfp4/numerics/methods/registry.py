"""The scale methods, by name: each is one module of `catalog/` that defines `PLUGIN = ScaleMethodSpec(...)`.

Adding a method is adding a file there (and its tests): `METHODS` (a `kimi_nvfp4.plugins.Registry`) imports every
module of the catalog, and `ScaleMethod` (the closed vocabulary the CLI, the API and manifests use) is built from
what it found. A method is a weight-error search (`BlockSearch`: candidates and tensor scale, run by
`search/group.py` on every execution path), for output-aware methods a refinement that uses calibration statistics
of the experts' inputs, its typed options (`options_model`: what `--method-option KEY=VALUE`, a stage's
`method_options` and the manifest hold), and the execution paths it offers.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from pydantic import BaseModel

from ...plugins import Plugin, PluginError, Registry
from .search.group import BlockSearch

__all__ = [
    "DEFAULT_METHOD",
    "METHODS",
    "ExecutionPath",
    "ScaleMethod",
    "ScaleMethodSpec",
    "StatisticsNeed",
    "method_spec",
    "weight_only_methods",
]


class StatisticsNeed(str, Enum):
    """What a method needs from calibration besides the INT4 weights."""

    NONE = "none"  # weight-only: `convert` runs it
    DIAGONAL = "diagonal"  # each input channel's mean energy E[x_j**2] per expert
    HESSIAN = "hessian"  # the dense input Hessian X^T X / n per expert (falls back to the diagonal)
    # the served (W4A4) input's moments per expert: E[x x^T], E[x~ x~^T], E[x x~^T] with x~ the NVFP4-quantized x
    # (falls back to their diagonals)
    W4A4_HESSIAN = "w4a4-hessian"

    @property
    def dense(self) -> bool:
        """Whether a method with this need wants dense matrices where there are trustworthy ones."""
        return self in (StatisticsNeed.HESSIAN, StatisticsNeed.W4A4_HESSIAN)


class ExecutionPath(str, Enum):
    """Where a method's rule can run. Every path a method offers gives the bytes its reference gives (weight-only
    methods: bit-exact, tests/numerics/test_paths.py; GPTQ: up to BLAS order, docs/numerics.md)."""

    CPU_REFERENCE = "cpu-reference"  # torch ops on the CPU: the definition
    CPU_TABLES = "cpu-tables"  # byte lookups and precomputed tables (search/cpu_tables.py)
    TORCH_CUDA = "torch-cuda"  # the same torch ops on a CUDA device
    TRITON = "triton"  # fused Triton kernels on CUDA


@dataclass(frozen=True)
class ScaleMethodSpec(Plugin):
    """One scale method (a `plugins.Plugin`: `name`, `description`, `options_model`, `aliases`).

    `search`: the weight-error search (for output-aware methods, the one whose result they start from and never do
    worse than); `statistics`/`refine`: what an output-aware method needs and the function that improves the
    search's result with it, called as `refine(items, options)` with this method's options (output_aware/refine.py);
    `paths`: the execution paths it offers; `no_triton`: why it has no Triton path (required exactly when TRITON is
    not among `paths`; the notice printed when it runs on CUDA says it).
    """

    search: BlockSearch
    statistics: StatisticsNeed = StatisticsNeed.NONE
    refine: Callable[..., Any] | None = None
    paths: tuple[ExecutionPath, ...] = field(default=tuple(ExecutionPath), kw_only=True)
    no_triton: str | None = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        if (self.statistics is StatisticsNeed.NONE) != (self.refine is None):
            raise ValueError(f"scale method {self.name!r}: a refinement needs statistics and statistics a refinement")
        if (ExecutionPath.TRITON in self.paths) == bool(self.no_triton):
            raise ValueError(f"scale method {self.name!r}: say why it has no Triton path (no_triton=...) exactly "
                             "when `paths` leaves TRITON out")

    @property
    def weight_only(self) -> bool:
        return self.statistics is StatisticsNeed.NONE

    def notice_path(self, device: Any) -> None:
        """On CUDA, say once per process that this method runs its torch path there, and why (its rule is one the
        Triton kernels cannot take): a slower run is announced, never silent."""
        if getattr(device, "type", str(device).split(":")[0]) == "cuda" and ExecutionPath.TRITON not in self.paths:
            _notice_once(self.name, self.no_triton or "")


@functools.cache
def _notice_once(name: str, reason: str) -> None:
    print(f"note: scale method {name} has no Triton path ({reason}); running its torch path on CUDA (slower)",
          file=sys.stderr, flush=True)


def _registry_order(spec: ScaleMethodSpec) -> tuple[bool, str]:
    # Weight-only methods first, then by name: the order of `--method` choices and of the docs.
    return (not spec.weight_only, spec.name)


METHODS: Registry[ScaleMethodSpec] = Registry(
    "scale method", ScaleMethodSpec, f"{__package__}.catalog", order=_registry_order)

ScaleMethod = Enum("ScaleMethod", {name.upper().replace("-", "_"): name for name in METHODS.names()}, type=str)
ScaleMethod.__doc__ = "The registered scale methods' names (`str` values: 'amax', 'int4-aware', ...)."
ScaleMethod.__module__ = __name__

DEFAULT_METHOD = ScaleMethod("int4-aware")


def method_spec(method: ScaleMethod | str) -> ScaleMethodSpec:
    """The spec of a registered method (a ValueError naming the registered ones for anything else)."""
    return METHODS.get(method.value if isinstance(method, ScaleMethod) else str(method))


def weight_only_methods() -> list[ScaleMethod]:
    """The methods `convert` can run (no calibration statistics needed)."""
    return [ScaleMethod(spec.name) for spec in METHODS.entries() if spec.weight_only]


def method_options(method: ScaleMethod | str, values: Mapping[str, Any] | BaseModel | None = None) -> BaseModel:
    """`method`'s typed options from a mapping (`--method-option` pairs, a pipeline.toml table) or a model;
    a PluginError (ValueError) naming the option and the method's options for anything it refuses."""
    return method_spec(method).parse_options(values)


__all__ += ["PluginError", "method_options"]
