"""Validate's memory plan (stage_kit/memory_plan.py): the INT4 stream, one per NVFP4 mode and the amax baseline's,
over two checkpoints per layer; the plan the stage makes before its first layer, and the one `--dry-run` prints."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..checkpoint.k2_config import K2Config
from ..checkpoint.reader import CheckpointReader
from ..stage_kit.device import resolve_dtype
from ..stage_kit.memory_plan import MemoryPlan, plan_stage, planning_device, rank_tokens
from .baseline import baseline_enabled
from .options import ValidateOptions


def validation_plan(cfg: K2Config, opts: ValidateOptions, device: torch.device, dtype: torch.dtype, tokens: int,
                    baseline: bool) -> MemoryPlan:
    return plan_stage(cfg, opts, stage="validate", device=device, dtype=dtype, tokens=tokens,
                      streams=1 + len(opts.modes) + int(baseline), sources=2, baseline=baseline)


def plan_validation(output: str | Path, options: ValidateOptions | None = None, **overrides: Any) -> MemoryPlan:
    """The memory plan `validate_checkpoint` would make for OUTPUT from its config alone (no weights, no data),
    for `samples x seq_len` tokens shared by the torchrun ranks; `kimi-nvfp4 validate --dry-run` prints it."""
    opts = ValidateOptions.build(options, overrides, "plan_validation")
    dev = planning_device(opts.device)
    total = opts.samples * opts.seq_len
    return validation_plan(CheckpointReader(Path(output)).layout.text, opts, dev, resolve_dtype(opts.dtype, dev),
                           rank_tokens(total), baseline_enabled(opts.baseline, total))
