"""The memory of an output-aware method solved inside calibrate (`calibrate --method`): how many experts one solve
batch takes, planned from what the stage's memory plan leaves, never a constant.

Two components beside calibrate's own plan (`memory_plan.py`), both on the device the statistics live on:
- `expert_hessians`: one MoE layer's statistics sums, held from the observe pass until the layer is solved:
  n_experts x (hidden^2 + moe_intermediate^2) x the sums' element size (dense methods; 4 bytes on a GPU, where the
  sums are float32, 8 on the CPU) plus the same again as the float32 statistics the solver reads (a dtype cast of
  the sums; on a GPU a no-op that allocates nothing, counted anyway as the planner counts conservatively);
- `expert_solve_batch`: per expert of a batch, the solver's float64 working set at the widest input (gate/up reads
  `hidden`): SOLVE_MATRICES in x in matrices (the shrunk H, its dead-channel copy, the flipped and dampened copy,
  its Cholesky factor, the inverse factor and its cast) and SOLVE_ROW_COPIES rows x in matrices (the target, the
  working copy, the errors) for the 2 x moe_intermediate rows of gate+up.
The batch is what the budget left after calibrate's peak and the Hessians holds, capped at the layer's experts.
K2.6 (384 experts, 7168 / 2048, float32 sums): the Hessians alone are 85 GB per layer.
"""

from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict

from ..checkpoint.k2_config import K2Config
from ..errors import ResourceError
from .memory_plan import MemoryPlan, format_bytes

SOLVE_MATRICES = 6
SOLVE_ROW_COPIES = 3
FLOAT64_BYTES = 8


class ExpertSolvePlan(BaseModel):
    """What `plan_expert_solve` decided (recorded beside calibrate's memory plan)."""

    model_config = ConfigDict(extra="forbid")

    hessian_bytes: int  # one layer's statistics, sums and the solver's view of them
    solve_bytes_per_expert: int
    budget_left_bytes: int  # what calibrate's own peak leaves on the statistics' device
    batch_experts: int


def sums_element_bytes(device: torch.device) -> int:
    """The statistics sums' element size: float64 on the CPU (the reference), float32 on a GPU (expert_stats.py)."""
    return 8 if device.type == "cpu" else 4


def hessian_bytes(cfg: K2Config, device: torch.device, *, dense: bool = True) -> int:
    """One MoE layer's per-expert statistics (module docstring), dense or channel energies only."""
    widths = (cfg.hidden_size, cfg.moe_intermediate_size)
    per_expert = sum(w * w if dense else w for w in widths)
    return cfg.n_routed_experts * per_expert * (sums_element_bytes(device) + 4)


def solve_bytes_per_expert(cfg: K2Config) -> int:
    width, rows = cfg.hidden_size, 2 * cfg.moe_intermediate_size
    return FLOAT64_BYTES * (SOLVE_MATRICES * width * width + SOLVE_ROW_COPIES * rows * width)


def plan_expert_solve(cfg: K2Config, plan: MemoryPlan, device: torch.device, *, dense: bool = True) -> ExpertSolvePlan:
    """The solve batch for calibrate's `plan` on `device`; adds both components to `plan.components`. A
    ResourceError (exit 10) when not even one expert fits beside the layer's Hessians."""
    if device.type == "cuda":
        budget, peak = plan.gpu_budget_bytes, plan.estimated_peak_gpu_bytes
    else:
        budget, peak = plan.host_budget_bytes, plan.estimated_peak_host_bytes
    hessians = hessian_bytes(cfg, device, dense=dense)
    per_expert = solve_bytes_per_expert(cfg)
    left = budget - peak - hessians
    if left < per_expert:
        raise ResourceError(
            f"calibrate --method: one MoE layer's expert statistics ({format_bytes(hessians)}) and one expert's solve "
            f"({format_bytes(per_expert)}) do not fit beside calibrate's own peak ({format_bytes(peak)}) in "
            f"{format_bytes(budget)} on {device}; give the stage more memory (--gpu-memory) or fewer tokens per "
            f"chunk (--max-chunk-tokens)")
    batch = min(cfg.n_routed_experts, left // per_expert)
    plan.components["expert_hessians"] = hessians
    plan.components["expert_solve_batch"] = batch * per_expert
    return ExpertSolvePlan(hessian_bytes=hessians, solve_bytes_per_expert=per_expert, budget_left_bytes=budget - peak,
                           batch_experts=int(batch))


__all__ = ["ExpertSolvePlan", "hessian_bytes", "plan_expert_solve", "solve_bytes_per_expert", "sums_element_bytes"]
