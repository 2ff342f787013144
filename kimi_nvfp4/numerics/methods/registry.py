"""The scale methods, by name: each is one module of `catalog/` that defines `METHOD = ScaleMethodSpec(...)`.

Adding a method is adding a file there (and its tests): the registry imports every module of the catalog, and
`ScaleMethod` (the closed vocabulary the CLI, the API and manifests use) is built from what it found. A method is
a weight-error search (`BlockSearch`: candidates and tensor scale, run by `search/group.py` on every execution
path) and, for output-aware methods, a refinement that uses calibration statistics of the experts' inputs.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from .search.group import BlockSearch

__all__ = [
    "DEFAULT_METHOD",
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


@dataclass(frozen=True)
class ScaleMethodSpec:
    """One scale method.

    `name`: what users type (`--method`); `description`: one line for the model card and docs; `search`: the
    weight-error search (for output-aware methods, the one whose result they start from and never do worse
    than); `statistics`/`refine`: what an output-aware method needs and the function that improves the search's
    result with it (see `output_aware/refine.py`).
    """

    name: str
    description: str
    search: BlockSearch
    statistics: StatisticsNeed = StatisticsNeed.NONE
    refine: Callable[..., Any] | None = None

    def __post_init__(self) -> None:
        if (self.statistics is StatisticsNeed.NONE) != (self.refine is None):
            raise ValueError(f"scale method {self.name!r}: a refinement needs statistics and statistics a refinement")


_CATALOG = Path(__file__).with_name("catalog")


def _discover() -> dict[str, ScaleMethodSpec]:
    specs: dict[str, ScaleMethodSpec] = {}
    for info in pkgutil.iter_modules([str(_CATALOG)]):
        module = importlib.import_module(f"{__package__}.catalog.{info.name}")
        spec = getattr(module, "METHOD", None)
        if not isinstance(spec, ScaleMethodSpec):
            raise TypeError(f"{module.__name__} defines no METHOD = ScaleMethodSpec(...)")
        if spec.name in specs:
            raise ValueError(f"scale method {spec.name!r} is defined twice")
        specs[spec.name] = spec
    # Weight-only methods first, then by name: the order of `--method` choices and of docs.
    return dict(sorted(specs.items(), key=lambda kv: (kv[1].statistics is not StatisticsNeed.NONE, kv[0])))


_SPECS = _discover()

ScaleMethod = Enum("ScaleMethod", {name.upper().replace("-", "_"): name for name in _SPECS}, type=str)
ScaleMethod.__doc__ = "The registered scale methods' names (`str` values: 'amax', 'int4-aware', ...)."
ScaleMethod.__module__ = __name__

DEFAULT_METHOD = ScaleMethod("int4-aware")


def method_spec(method: ScaleMethod | str) -> ScaleMethodSpec:
    """The spec of a registered method (ValueError naming the registered ones for anything else)."""
    name = method.value if isinstance(method, ScaleMethod) else str(method)
    if name not in _SPECS:
        raise ValueError(f"unknown scale method {name!r}; registered: {', '.join(_SPECS)}")
    return _SPECS[name]


def weight_only_methods() -> list[ScaleMethod]:
    """The methods `convert` can run (no calibration statistics needed)."""
    return [ScaleMethod(n) for n, spec in _SPECS.items() if spec.statistics is StatisticsNeed.NONE]
