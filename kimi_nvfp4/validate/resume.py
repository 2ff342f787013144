"""validate's resume snapshot (stage_kit/resume.py): what `compare_streams` needs to continue after layer L.

- every hidden-state stream still running (INT4, one per NVFP4 mode, the amax baseline), one tensor per sequence;
- the per-layer entries, per-expert errors, modes that stopped and why, seconds and peak memory per layer;
- the weight check's running summary (`WeightComparer`'s accumulators);
- on rank 0, the structural scan's report, so that a resume does not read every tensor again.
Every figure in them is already combined over the ranks (validate/ranks.py), so each rank's copy is the job's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field

from ..checkpoint.reader import CheckpointReader
from ..distributed import RankContext
from ..model.linear import ActivationMode
from ..model.runner import HiddenStates, LayerStreamRunner
from ..numerics.methods import MatrixErrorStats
from ..stage_kit.layer_memory import LayerMemory
from ..stage_kit.resume import ResumeStore, Snapshot
from ..stage_kit.resume_fingerprint import checkpoint_identity, compute_identity, run_identity
from .experts import ExpertError
from .options import ValidateOptions
from .report import LayerValidation
from .structure import StructureReport
from .weights import LayerWeightError, MatrixComparison, WeightComparer

INT4_STREAM, BASELINE_STREAM = "int4", "baseline"
# WeightComparer's running sums (validate/weights.py), by attribute: the snapshot keeps exactly these
_COMPARER_FIELDS = ("_flagged", "_flagged_count", "_all", "_rel_sum", "_rel_max", "_layers", "_worst", "_unreadable")


class WeightComparerState(BaseModel):
    model_config = ConfigDict(extra="forbid", ser_json_inf_nan="constants")

    flagged: list[str]
    flagged_count: int
    all: list[MatrixErrorStats]
    rel_sum: float
    rel_max: float
    layers: list[LayerWeightError]
    worst: list[tuple[float, str, MatrixComparison]]  # a heap: kept in its order
    unreadable: list[str]

    @classmethod
    def of(cls, comparer: WeightComparer) -> "WeightComparerState":
        return cls(**{name.lstrip("_"): getattr(comparer, name) for name in _COMPARER_FIELDS})

    def restore(self, comparer: WeightComparer) -> None:
        for name in _COMPARER_FIELDS:
            value = getattr(self, name.lstrip("_"))
            setattr(comparer, name, list(value) if isinstance(value, list) else value)


class ValidationSnapshot(BaseModel):
    """The small part of a validate snapshot (the streams travel beside it in the safetensors file)."""

    model_config = ConfigDict(extra="forbid", ser_json_inf_nan="constants")

    layers: list[LayerValidation]
    expert_errors: list[ExpertError]
    mode_errors: dict[str, str]
    layer_seconds: list[float]
    phase_seconds: list[dict[str, float]] = Field(default_factory=list)
    layer_memory: LayerMemory = Field(default_factory=LayerMemory)  # per layer, peak GPU / host memory
    modes: list[str]  # NVFP4 streams still running
    baseline: bool  # the baseline stream is running
    comparer: WeightComparerState
    structure: StructureReport | None = None  # rank 0's


def validation_fingerprint(
    out_reader: CheckpointReader, src_reader: CheckpointReader, ctx: RankContext, data: str,
    sequences: list[torch.Tensor], opts: ValidateOptions, *, device: torch.device, dtype: torch.dtype,
    baseline: bool, flag_rel_mse: float,
) -> dict[str, Any]:
    """Everything that decides validate's figures for this rank (stage_kit/resume_fingerprint.py)."""
    return {
        **run_identity("validate", ctx, data, sequences),
        "checkpoint": checkpoint_identity(out_reader),
        "source": checkpoint_identity(src_reader),
        "options": {**opts.recorded(), "baseline": baseline, "flag_rel_mse": flag_rel_mse},
        "compute": compute_identity(device, dtype),
    }


@dataclass
class ValidationResume:
    """The store, the snapshot this run continues from (if any), and rank 0's structural scan to carry along."""

    store: ResumeStore
    snapshot: Snapshot | None = None
    structure: StructureReport | None = None

    def saved_structure(self) -> StructureReport | None:
        return None if self.snapshot is None else self.snapshot.parse(ValidationSnapshot).structure

    def save(self, layer: int, ref: HiddenStates, states: dict[ActivationMode, HiddenStates],
             base: HiddenStates | None, result: Any, comparer: WeightComparer) -> bool:
        """Snapshot `compare_streams` after `layer` (`result`: its StreamComparison)."""
        state = ValidationSnapshot(
            layers=result.layers, expert_errors=result.expert_errors, mode_errors=result.mode_errors,
            layer_seconds=result.layer_seconds, phase_seconds=result.phase_seconds, layer_memory=result.memory,
            modes=[m.value for m in states],
            baseline=base is not None,
            comparer=WeightComparerState.of(comparer), structure=self.structure,
        )
        streams = {INT4_STREAM: ref.sequences, **{m.value: s.sequences for m, s in states.items()}}
        if base is not None:
            streams[BASELINE_STREAM] = base.sequences
        return self.store.save(layer, state, streams)

    def restore(self, result: Any, comparer: WeightComparer, ref_runner: LayerStreamRunner,
                nv_runner: LayerStreamRunner, wanted: list[ActivationMode]):
        """Fill `result` and `comparer` from the snapshot; returns (INT4 stream, NVFP4 streams by mode, baseline
        stream or None, first layer to run)."""
        snap = self.snapshot
        state = snap.parse(ValidationSnapshot)
        result.layers = list(state.layers)
        result.expert_errors = list(state.expert_errors)
        result.mode_errors = dict(state.mode_errors)
        result.layer_seconds = list(state.layer_seconds)
        result.phase_seconds = list(state.phase_seconds)
        result.memory = state.layer_memory.model_copy(deep=True)
        state.comparer.restore(comparer)

        def stream(name: str, runner: LayerStreamRunner) -> HiddenStates:
            return HiddenStates(snap.stream(name, runner.states_device, runner.dtype))

        ref = stream(INT4_STREAM, ref_runner)
        states = {m: stream(m.value, nv_runner) for m in wanted if m.value in state.modes}
        base = stream(BASELINE_STREAM, nv_runner) if state.baseline else None
        return ref, states, base, snap.layer + 1
