"""`act-diag`: per block, the E4M3 scale minimising the output error under the diagonal of the input Hessian.

Starting from int4-aware (its tensor scale, its block scales), each block takes, among the E4M3 scales within one
binade of int4-aware's (+-8 steps; equal to the exhaustive choice on all but ~1e-5 of the blocks), the one minimising `sum_j E[x_j**2] * (w_j - q_j)**2` with the expert's channel energies from calibration
(damped by `energy_damping` of their mean, default `weighted_search.ENERGY_DAMPING` = 1%), int4-aware's choice kept on a tie. Same bytes on
CPU and GPU (elementwise float64 operations and fixed-order sums). The driver (`output_aware/refine.py`) keeps
int4-aware's result for any matrix whose calibration-weighted output error would not be smaller.
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict, Field

from ...nvfp4 import NVFP4Tensor
from ..output_aware.refine import RefineInput
from ..output_aware.weighted_search import ENERGY_DAMPING, WINDOW, damped_energy, refine_by_channel_energy
from ..registry import ExecutionPath, ScaleMethodSpec, StatisticsNeed
from .int4_aware import INT4_AWARE_SEARCH


class ActDiagOptions(BaseModel):
    """act-diag's options (`--method-option KEY=VALUE`; the defaults are what was measured, docs/numerics.md)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    energy_damping: float = Field(ENERGY_DAMPING, ge=0, description="added to every channel's energy, as a fraction "
                                                                    "of their mean")
    window_steps: int = Field(WINDOW[1], ge=0, le=126, description="E4M3 bit steps tried either side of int4-aware's "
                                                                   "block scale")


def refine_diagonal(items: Sequence[RefineInput], options: ActDiagOptions | None = None) -> list[list[NVFP4Tensor]]:
    """Each matrix's block scales re-chosen by channel-energy-weighted error (diagonal statistics)."""
    options = options or ActDiagOptions()
    window = (-options.window_steps, options.window_steps)
    out = []
    for item in items:
        energy = damped_energy(item.stats.channel_energy, options.energy_damping)
        out.append([refine_by_channel_energy(m, q, energy, window) for m, q in zip(item.matrices, item.search)])
    return out


PLUGIN = ScaleMethodSpec(
    name="act-diag",
    description=(
        "int4-aware, then per 16-value block the E4M3 scale (within a binade of int4-aware's) with the least error "
        "weighted by each input channel's calibration energy E[x²]; never worse than int4-aware on that weighted "
        "output error."
    ),
    search=INT4_AWARE_SEARCH,
    statistics=StatisticsNeed.DIAGONAL,
    refine=refine_diagonal,
    options_model=ActDiagOptions,
    paths=(ExecutionPath.CPU_REFERENCE, ExecutionPath.CPU_TABLES, ExecutionPath.TORCH_CUDA),
    no_triton="its weighted search is gathers and fixed-order float64 sums, written in torch only",
)
