"""The memory of an output-aware method solved inside calibrate (`calibrate --method`): how many experts' statistics
are held at once (an expert group) and how many experts one solve batch takes, planned from what the stage's memory
plan leaves, never constants.

Two components beside calibrate's own plan (`memory_plan.py`), both on the device the statistics live on:
- `expert_hessians`: one expert group's statistics sums, held from the group's pass until it is solved:
  experts x (hidden^2 + moe_intermediate^2) x the sums' element size (dense methods; 4 bytes on a GPU, where the
  sums are float32, 8 on the CPU). Converting them to the statistics the solver reads consumes the sums expert by
  expert (`layer_stats_tensors(consume=True)`), so the two are never both held whole;
- `expert_solve_batch`: per expert of a batch, the solver's float64 working set at the widest input (gate/up reads
  `hidden`): SOLVE_MATRICES in x in matrices and SOLVE_ROW_COPIES rows x in matrices (the target, the working
  copy, the errors) for the 2 x moe_intermediate rows of gate+up. The matrices: the solver holds at most four at
  once (`gptq_solver.hessian_factor`: the caller's stacked H, its flipped dead-channel copy, the dampened copy and
  its Cholesky factor; then H, the flipped copy, the factor and the factor flipped back); a damping retry's copy of
  the experts that failed adds up to one; one more is margin for cuSOLVER's workspace and the caller's per-expert
  shrunk H (alive while `catalog/gptq.py refine_dense` stacks them, before the solver's own).
K2.6 (384 experts, 7168 / 2048, float32 sums): the statistics of a whole layer are 85 GB, more than an H200 has
beside calibrate's own peak. Then the layer's experts are taken in groups (calibrate/fused_method.py): the first
group's statistics come from calibrate's observe pass, each later group's from a statistics-only pass of the MoE
over the same post-attention states that runs that group's experts alone -- about one more routed-expert pass per
layer in all, the attention never recomputed. The solve runs between passes and may also use the chunk buffers
the passes free; when the layer's statistics do not fit at once, a quarter of that goes to the solve batch.
"""

from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict

from ..checkpoint.k2_config import K2Config
from ..errors import ResourceError
from .memory_plan import MemoryPlan, format_bytes

SOLVE_MATRICES = 6
# calibrate's own plan leaves room for a group of at least 1/MIN_GROUP_FRACTION of a layer's experts and one solve
# (`method_reserve_bytes`): at most that many statistics passes per MoE layer
MIN_GROUP_FRACTION = 8
SOLVE_SHARE = 4  # when the layer's statistics do not fit at once: 1/SOLVE_SHARE of what is left goes to the solve
SOLVE_ROW_COPIES = 3
FLOAT64_BYTES = 8


class ExpertSolvePlan(BaseModel):
    """What `plan_expert_solve` decided (recorded beside calibrate's memory plan)."""

    model_config = ConfigDict(extra="forbid")

    hessian_bytes: int  # one expert group's statistics sums
    solve_bytes_per_expert: int
    budget_left_bytes: int  # what calibrate's own peak leaves on the statistics' device
    group_experts: int  # experts whose statistics are held at once (all of a layer's when they fit)
    groups: int  # statistics passes per MoE layer (1: calibrate's observe pass alone)
    batch_experts: int


def sums_element_bytes(device: torch.device) -> int:
    """The statistics sums' element size: float64 on the CPU (the reference), float32 on a GPU (expert_stats.py)."""
    return 8 if device.type == "cpu" else 4


def hessian_bytes(cfg: K2Config, device: torch.device, *, dense: bool = True, experts: int | None = None) -> int:
    """The statistics sums of `experts` (default: all of a layer's) experts (module docstring), dense or channel
    energies only."""
    widths = (cfg.hidden_size, cfg.moe_intermediate_size)
    per_expert = sum(w * w if dense else w for w in widths)
    return (cfg.n_routed_experts if experts is None else experts) * per_expert * sums_element_bytes(device)


def solve_bytes_per_expert(cfg: K2Config) -> int:
    width, rows = cfg.hidden_size, 2 * cfg.moe_intermediate_size
    return FLOAT64_BYTES * (SOLVE_MATRICES * width * width + SOLVE_ROW_COPIES * rows * width)


def method_reserve_bytes(cfg: K2Config, device: torch.device, *, dense: bool = True) -> int:
    """What calibrate's own memory plan leaves free for the method (`plan_memory(reserve_bytes=...)`)."""
    group = -(-cfg.n_routed_experts // MIN_GROUP_FRACTION)
    return hessian_bytes(cfg, device, dense=dense, experts=group) + solve_bytes_per_expert(cfg)


def plan_expert_solve(cfg: K2Config, plan: MemoryPlan, device: torch.device, *, dense: bool = True) -> ExpertSolvePlan:
    """The expert group and solve batch for calibrate's `plan` on `device`; adds both components to
    `plan.components`. A ResourceError (exit 10) when not even one expert's statistics and solve fit."""
    if device.type == "cuda":
        budget, peak = plan.gpu_budget_bytes, plan.estimated_peak_gpu_bytes
    else:
        budget, peak = plan.host_budget_bytes, plan.estimated_peak_host_bytes
    n = cfg.n_routed_experts
    per_hessian = hessian_bytes(cfg, device, dense=dense, experts=1)
    per_solve = solve_bytes_per_expert(cfg)
    left = budget - peak
    # The solve runs between the layer's passes, when their chunk buffers are free: it may use them too. A group's
    # statistics are held through its rerun pass, beside those buffers: they must fit in what the peak leaves.
    between_passes = left + plan.components.get("chunk_work", 0)
    if n * per_hessian <= left and n * per_hessian + per_solve <= between_passes:
        group = n
    else:
        solve_room = max(per_solve, between_passes // SOLVE_SHARE)
        group = max(0, min(n, (between_passes - solve_room) // per_hessian, left // per_hessian))
    batch = min(group, (between_passes - group * per_hessian) // per_solve) if group else 0
    if batch < 1:
        raise ResourceError(
            f"calibrate --method: one expert's statistics ({format_bytes(per_hessian)}) and its solve "
            f"({format_bytes(per_solve)}) do not fit beside calibrate's own peak ({format_bytes(peak)}) in "
            f"{format_bytes(budget)} on {device}; give the stage more memory (--gpu-memory) or fewer tokens per "
            f"chunk (--max-chunk-tokens)")
    plan.components["expert_hessians"] = group * per_hessian
    plan.components["expert_solve_batch"] = batch * per_solve
    return ExpertSolvePlan(hessian_bytes=group * per_hessian, solve_bytes_per_expert=per_solve,
                           budget_left_bytes=budget - peak, group_experts=int(group), groups=-(-n // group),
                           batch_experts=int(batch))


__all__ = ["ExpertSolvePlan", "hessian_bytes", "method_reserve_bytes", "plan_expert_solve", "solve_bytes_per_expert", "sums_element_bytes"]
