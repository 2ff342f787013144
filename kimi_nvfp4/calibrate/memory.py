"""Calibrate's memory plan (stage_kit/memory_plan.py): one hidden-state stream over one checkpoint per layer; the
plan the stage makes before its first layer, and the one `--dry-run` prints from the config alone."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..checkpoint.k2_config import K2Config
from ..checkpoint.reader import CheckpointReader
from ..stage_kit.device import resolve_dtype
from ..stage_kit.expert_solve_plan import ExpertSolvePlan, method_reserve_bytes, plan_expert_solve
from ..stage_kit.memory_plan import MemoryPlan, plan_stage, planning_device, rank_tokens
from .options import CalibrateOptions


def calibration_plan(cfg: K2Config, opts: CalibrateOptions, device: torch.device, dtype: torch.dtype,
                     tokens: int) -> MemoryPlan:
    """With `--method`, the layer loop's plan leaves room for the method's statistics and solve, which
    `method_solve_plan` then sizes from what is left (stage_kit/expert_solve_plan.py)."""
    reserve = 0 if opts.method is None else method_reserve_bytes(cfg, device, dense=_dense(opts))
    return plan_stage(cfg, opts, stage="calibrate", device=device, dtype=dtype, tokens=tokens, streams=1, sources=1,
                      reserve_bytes=reserve)


def _dense(opts: CalibrateOptions) -> bool:
    from .expert_stats import expert_stats_mode_for

    return expert_stats_mode_for(opts.method.value).dense


def method_solve_plan(cfg: K2Config, opts: CalibrateOptions, plan: MemoryPlan, device: torch.device
                      ) -> ExpertSolvePlan | None:
    """`--method`'s expert groups and solve batch in what `plan` leaves (None without a method)."""
    return None if opts.method is None else plan_expert_solve(cfg, plan, device, dense=_dense(opts))


def plan_calibration(output: str | Path, options: CalibrateOptions | None = None, **overrides: Any) -> MemoryPlan:
    """The memory plan `calibrate_checkpoint` would make for OUTPUT, from its config alone (no weights, no data):
    for `samples x seq_len` tokens shared by the torchrun ranks (WORLD_SIZE), on `device` even if it is not here
    (`gpu_memory` then says how much it has). `kimi-nvfp4 calibrate --dry-run` prints it."""
    opts = CalibrateOptions.build(options, overrides, "plan_calibration")
    dev = planning_device(opts.device)
    cfg = CheckpointReader(Path(output)).layout.text
    plan = calibration_plan(cfg, opts, dev, resolve_dtype(opts.dtype, dev), rank_tokens(opts.samples * opts.seq_len))
    method_solve_plan(cfg, opts, plan, dev)  # adds the method's components to the plan
    return plan
