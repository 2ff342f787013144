"""calibrate's resume snapshot (stage_kit/resume.py): what `run_calibration` needs to continue after layer L.

- the hidden states (layer L+1's input, W4A4 up to L), one tensor per sequence of this rank;
- the input scales chosen so far (exact fp32 tensors) and the report entries, seconds, peak memory and dequantized
  layers;
- this rank's FP8 KV-cache ranges (combined over ranks only at the end) and, with `--expert-stats`, the
  statistics files rank 0 already wrote (their names and sha256) and their counts.
The per-layer activation statistics files are already on disk; the collector starts afresh at each layer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field

from ..checkpoint.reader import CheckpointReader
from ..distributed import RankContext
from ..model.runner import HiddenStates, LayerStreamRunner
from ..stage_kit.layer_memory import LayerMemory
from ..stage_kit.resume import ResumeStore, Snapshot
from ..stage_kit.resume_fingerprint import checkpoint_identity, compute_identity, run_identity
from .expert_stats_file import LayerStatsCounts
from .expert_stats_hook import ExpertStatsHook
from .options import CalibrateOptions
from .report import LayerCalibration
from .shard import CALIBRATE_STAGE

HIDDEN_STREAM = "hidden"
SCALES_GROUP = "input_scale"
KV_LATENT_GROUP, KV_ROPE_GROUP = "kv_latent", "kv_rope"


class CalibrationSnapshot(BaseModel):
    """The small part of a calibrate snapshot (tensors travel beside it in the safetensors file)."""

    model_config = ConfigDict(extra="forbid", ser_json_inf_nan="constants")

    layers: list[LayerCalibration]
    layer_seconds: list[float]
    phase_seconds: list[dict[str, float]] = Field(default_factory=list)
    layer_memory: LayerMemory = Field(default_factory=LayerMemory)  # per layer, peak GPU / host memory
    materialized_layers: list[int]
    kv_tokens: dict[int, int] | None = None  # None: the run records no KV-cache ranges
    expert_stats_files: dict[str, str] = Field(default_factory=dict)
    expert_stats_counts: list[LayerStatsCounts] = Field(default_factory=list)


def calibration_fingerprint(
    reader: CheckpointReader, ctx: RankContext, data: str, sequences: list[torch.Tensor], opts: CalibrateOptions,
    *, device: torch.device, dtype: torch.dtype, stats_dir: Path | None,
    kv_cache: bool,
) -> dict[str, Any]:
    """Everything that decides calibrate's results for this rank (stage_kit/resume_fingerprint.py)."""
    return {
        **run_identity(CALIBRATE_STAGE, ctx, data, sequences),
        "checkpoint": checkpoint_identity(reader),
        "options": {**opts.recorded(), "expert_stats": opts.expert_stats.value},
        "compute": compute_identity(device, dtype),
        "activation_stats_dir": None if stats_dir is None else str(stats_dir.resolve()),
        "kv_cache": kv_cache,
    }


def save_calibration(store: ResumeStore, layer: int, states: HiddenStates, run: Any,
                     expert_stats: ExpertStatsHook | None) -> bool:
    """Snapshot `run_calibration` after `layer` (`run`: its CalibrationRun)."""
    kv = run.kv_ranges
    state = CalibrationSnapshot(
        layers=run.layers, layer_seconds=run.layer_seconds, phase_seconds=run.phase_seconds, layer_memory=run.memory,
        materialized_layers=run.materialized_layers,
        kv_tokens=None if kv is None else dict(kv.tokens),
        expert_stats_files={} if expert_stats is None else dict(expert_stats.files),
        expert_stats_counts=[] if expert_stats is None else list(expert_stats.counts),
    )
    tensors = {SCALES_GROUP: dict(run.scales)}
    if kv is not None:
        tensors[KV_LATENT_GROUP] = {str(k): v for k, v in kv.latent.items()}
        tensors[KV_ROPE_GROUP] = {str(k): v for k, v in kv.rope.items()}
    return store.save(layer, state, {HIDDEN_STREAM: states.sequences}, tensors)


def restore_calibration(snapshot: Snapshot, run: Any, runner: LayerStreamRunner,
                        expert_stats: ExpertStatsHook | None, device: torch.device) -> HiddenStates:
    """Fill `run` (a fresh CalibrationRun) and `expert_stats` from `snapshot`; returns layer L+1's input."""
    state = snapshot.parse(CalibrationSnapshot)
    run.layers = list(state.layers)
    run.layer_seconds = list(state.layer_seconds)
    run.phase_seconds = list(state.phase_seconds)
    run.memory = state.layer_memory.model_copy(deep=True)
    run.materialized_layers = list(state.materialized_layers)
    run.scales = dict(snapshot.tensors(SCALES_GROUP))
    if run.kv_ranges is not None:
        run.kv_ranges.latent = {int(k): v.to(device) for k, v in snapshot.tensors(KV_LATENT_GROUP)}
        run.kv_ranges.rope = {int(k): v.to(device) for k, v in snapshot.tensors(KV_ROPE_GROUP)}
        run.kv_ranges.tokens = dict(state.kv_tokens or {})
    if expert_stats is not None:
        expert_stats.files = dict(state.expert_stats_files)
        expert_stats.counts = list(state.expert_stats_counts)
    return HiddenStates(snapshot.stream(HIDDEN_STREAM, runner.states_device, runner.dtype))


__all__ = ["CalibrationSnapshot", "calibration_fingerprint", "restore_calibration",
           "save_calibration"]
