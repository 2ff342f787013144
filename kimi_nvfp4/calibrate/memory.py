"""Calibrate's memory plan (stage_kit/memory_plan.py): one hidden-state stream over one checkpoint per layer; the
plan the stage makes before its first layer, and the one `--dry-run` prints from the config alone."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..checkpoint.k2_config import K2Config
from ..checkpoint.reader import CheckpointReader
from ..stage_kit.device import resolve_dtype
from ..stage_kit.memory_plan import MemoryPlan, plan_stage, planning_device, rank_tokens
from .options import CalibrateOptions


def calibration_plan(cfg: K2Config, opts: CalibrateOptions, device: torch.device, dtype: torch.dtype,
                     tokens: int) -> MemoryPlan:
    return plan_stage(cfg, opts, stage="calibrate", device=device, dtype=dtype, tokens=tokens, streams=1, sources=1)


def plan_calibration(output: str | Path, options: CalibrateOptions | None = None, **overrides: Any) -> MemoryPlan:
    """The memory plan `calibrate_checkpoint` would make for OUTPUT, from its config alone (no weights, no data):
    for `samples x seq_len` tokens shared by the torchrun ranks (WORLD_SIZE), on `device` even if it is not here
    (`gpu_memory` then says how much it has). `kimi-nvfp4 calibrate --dry-run` prints it."""
    opts = CalibrateOptions.build(options, overrides, "plan_calibration")
    dev = planning_device(opts.device)
    cfg = CheckpointReader(Path(output)).layout.text
    return calibration_plan(cfg, opts, dev, resolve_dtype(opts.dtype, dev), rank_tokens(opts.samples * opts.seq_len))
