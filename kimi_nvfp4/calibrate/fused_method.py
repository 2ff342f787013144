"""`calibrate --method gptq` (or act-diag): the routed experts requantized inside calibrate's layer loop, with the
statistics held in memory only.

Per MoE layer, `run_calibration` calls this hook as it calls `ExpertStatsHook`: the observe pass (W4A16, the layer
as convert wrote it) accumulates each routed expert's input statistics beside calibrate's collector; when it ends
(`observe_done`, after the ranks' sums are combined) the layer's statistics become exactly the tensors a statistics
file would hold (`layer_stats_tensors`: same dtypes, same dense threshold, kept on their device), the layer's
experts are solved from the INT4 source in batches of `batch_experts` (the memory planner's, stage_kit/
expert_solve_plan.py), the sums are freed, and the layer's new expert tensors are written to a staging file
`OUTPUT/calibration/fused_experts/layer_LLL.safetensors` (atomic). After the last layer (and after the input scales
and the report are written), `finalize` (calibrate/fused_finalize.py) rewrites every shard holding routed experts
from the staging files (requantize's `replace_in_shard`: the bytes requantize writes for the same values), records
them as requantize records them, and deletes the staging files.

Why staging instead of rewriting the shard at once: calibrate's resume snapshot is keyed to the shards' size and
mtime (stage_kit/resume_fingerprint.py), and a layer redone after a kill must observe the weights convert wrote,
not ones already requantized; shards are therefore only written once the loop is over, and a kill during that
last step is resumed by the same command from the staging files, without the layer loop (`pending_finalize`:
finalize records the staging files' digests, the method and its options in the staging folder before it starts).
The staging files hold weights (a layer's NVFP4 experts: 8.9 GiB at K2.6), never statistics (85 GB per layer at
K2.6): 0 bytes of statistics reach the disk unless `keep_stats` (a debug flag) asks for the files `requantize` reads.

Propagation (docs/numerics.md, "GPTQ inside calibrate"; `--propagation`): by default (`int4`) the next layer's
inputs come from the layer as convert wrote it (int4-aware weights, W4A4), not from the requantized layer: the fused
shards are then byte-identical to `calibrate --expert-stats hessian` followed by `requantize --no-recalibrate`, and
the input scales are those of the int4-aware layers (the down_proj input scale is not refreshed for the new gate/up
weights). `sequential` (the GPTQ paper's and llm-compressor's order) keeps the layer's solved tensors in memory
after staging them and, before the advance pass, swaps them into the loaded layer (`advance_weights`,
NVFP4Weights.replace_weights): the W4A4 advance pass, and so every later layer's statistics and input scales, see
the requantized experts. The layer's own input scales are still chosen in its observe pass, with the int4-aware
weights: the down_proj input scale was observed behind the int4-aware gate/up, not the solved ones (not
re-observed). Under torchrun the solved tensors go from rank 0 to every rank (one layer's experts: 8.9 GiB at K2.6).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as safetensors_load, save as safetensors_save

from ..checkpoint.reader import CheckpointReader
from ..stage_kit.device import PhaseClock
from ..checkpoint.writer import ShardWriter
from ..errors import ResourceError
from .expert_stats import DOWN, GATE_UP, CollectorWithExpertStats, ExpertStatsObserver, \
    expert_stats_mode_for
from .expert_stats_file import InMemoryLayerStats, LayerStatsCounts, layer_stats_name, layer_stats_tensors, \
    write_layer_stats

from .fused_finalize import FUSED_DIR, FUSED_RECORD, OUTCOME_KEY as _OUTCOME_KEY, finalize, pending_finalize, \
    require_not_requantized

log = logging.getLogger(__name__)


class FusedMethodHook:
    """Solves each MoE layer's experts when its observe pass ends (module docstring); rank 0 solves and writes."""

    def __init__(self, method: str, method_options: dict[str, Any], output: Path, source: CheckpointReader,
                 out_reader: CheckpointReader, *, batch_experts: int, group_experts: int | None = None,
                 keep_stats_dir: Path | None = None, propagation: str = "int4"):
        self.method = method
        if propagation not in ("int4", "sequential"):
            raise ValueError(f"propagation must be 'int4' or 'sequential', got {propagation!r}")
        self.propagation = propagation
        self._advance: dict[str, torch.Tensor] | None = None  # sequential: the layer's solved tensors
        self.method_options = method_options
        self.mode = expert_stats_mode_for(method)
        if self.mode.quantized:
            raise ValueError(f"calibrate --method {method}: its statistics come from the W4A4 pass of the layer it "
                             "changes; use calibrate --expert-stats w4a4 and requantize")
        self.directory = Path(output) / "calibration" / FUSED_DIR
        self.source, self.out_reader = source, out_reader
        self.batch_experts = batch_experts
        n_experts = out_reader.layout.text.n_routed_experts
        self.group_experts = min(n_experts, group_experts or n_experts)
        if keep_stats_dir is not None and self.group_experts < n_experts:
            raise ResourceError(f"--keep-expert-stats writes a layer's statistics at once, but only "
                                f"{self.group_experts} of {n_experts} experts' statistics fit in memory together")
        self.keep_stats_dir = keep_stats_dir
        self._files: dict[str, str] = {}  # staging file -> sha256 (the snapshot keeps it; read through `files`)
        self._writer_thread: ThreadPoolExecutor | None = None
        self._in_flight: Future | None = None
        self.counts: list[LayerStatsCounts] = []
        self.seconds: list[dict[str, float]] = []  # per MoE layer: rerun passes, statistics, solve, write
        self._observer: ExpertStatsObserver | None = None
        self._device = torch.device("cpu")

    # --- run_calibration's hook protocol (the one ExpertStatsHook follows) ---------------------------------------
    def observer(self, collector: Any, device: torch.device) -> Any:
        self._device = device
        self._observer = ExpertStatsObserver(self.mode, device)
        return CollectorWithExpertStats(collector, self._observer)

    def start_layer(self, layer: int) -> None:
        self._observer.start_layer(layer)
        if self.group_experts < self.out_reader.layout.text.n_routed_experts:
            self._observer.start_group(0, self.group_experts, first=True)

    def observe_done(self, layer: int, reader: CheckpointReader, ctx: Any,
                     rerun: Callable[[Any], None] | None = None) -> None:
        """Solve the layer's experts, a group at a time: the first group's statistics come from calibrate's
        observe pass; each later group's from `rerun(observer)`, a statistics-only pass of the layer's MLP over the
        same post-attention states in which the MoE runs that group's experts alone (model/moe.py), so every
        expert's sums are the ones a single pass would have made (batch-invariant rows, the same chunks)."""
        cfg = reader.layout.text
        if not cfg.is_moe_layer(layer):
            return
        n = cfg.n_routed_experts
        widths = {GATE_UP: cfg.hidden_size, DOWN: cfg.moe_intermediate_size}
        solved = _LayerSolve()
        clock = PhaseClock(self._device)
        for lo in range(0, n, self.group_experts):
            if lo:
                if rerun is None:
                    raise RuntimeError("calibrate --method with expert groups needs the layer's rerun pass")
                self._observer.start_group(lo, min(n, lo + self.group_experts), first=False)
                rerun(self._observer)
                clock.mark("rerun")
            self._observer.combine_ranks(ctx, widths, n)
            if ctx.is_main:
                if self.keep_stats_dir is not None:
                    write_layer_stats(self.keep_stats_dir, layer, self._observer)
                tensors, counts = layer_stats_tensors(layer, self._observer, device=None, consume=True)
                clock.mark("statistics")
                self._solve(layer, InMemoryLayerStats(layer, tensors), range(lo, lo + self.group_experts), solved)
                clock.mark("solve")
                solved.add_counts(counts)
                del tensors
        if ctx.is_main:
            self._write_layer(layer, solved)
            clock.mark("write")
        if self.propagation == "sequential":  # every rank's advance pass runs the solved experts
            self._advance = solved.tensors if not ctx.distributed else safetensors_load(ctx.broadcast_object(
                _as_bytes(solved.tensors) if ctx.is_main else None))  # (pickle loses float8 storages)
        if ctx.is_main:
            self.counts.append(solved.counts)
            self.seconds.append({phase: round(v, 3) for phase, v in clock.seconds.items()})
            log.info("calibrate --method %s: layer %d, %d expert group(s): %s", self.method, layer,
                     -(-n // self.group_experts), ", ".join(f"{k} {v:.1f} s" for k, v in clock.seconds.items()))
        self._observer.start_layer(layer)

    def advance_weights(self, source: Any, w: Any) -> None:
        """Before the advance pass: with sequential propagation, the layer's routed experts become the solved ones
        (`source`: the NVFP4Weights `w` was loaded from); with int4 propagation, nothing changes."""
        tensors, self._advance = self._advance, None
        if tensors:
            source.replace_weights(w, tensors)

    def advance_observer(self, weights: Any) -> None:
        return None

    def finish_layer(self, layer: int, reader: CheckpointReader, ctx: Any) -> None:
        pass

    # --- the solve -------------------------------------------------------------------------------------------------
    def _solve(self, layer: int, stats: InMemoryLayerStats, experts_in: range, solved: "_LayerSolve") -> None:
        from ..numerics.methods import requantize_experts
        from ..requantize.shard import expert_inputs_in, expert_matrices, expert_tensors

        items = sorted({item for file in self.out_reader.shard_files
                        for item in expert_inputs_in(self.out_reader, file)
                        if item.layer == layer and item.expert in experts_in})
        device = self._device
        for start in range(0, len(items), self.batch_experts):
            batch = items[start : start + self.batch_experts]
            experts = [expert_matrices(self.source, item, device, stats) for item in batch]
            summary = requantize_experts(self.method, experts, batch_experts=self.batch_experts,
                                         options=self.method_options)
            for item, refined in zip(batch, summary.experts, strict=True):
                solved.sources[refined.source.value] = solved.sources.get(refined.source.value, 0) + 1
                solved.kept += sum(refined.kept_search)
                solved.tensors.update(expert_tensors(self.out_reader, item, refined.tensors))
            solved.items += len(batch)

    def _write_layer(self, layer: int, solved: "_LayerSolve") -> None:
        """Stage the layer's tensors: copied to the host here, written and hashed on the writer thread while the
        next layer runs (8.9 GiB a K2.6 layer: ~14 s at the H200 host's rate, as long as a layer's forward). One
        layer is in flight at most: the previous one is waited for first, and `files` waits for it too."""
        outcome = {"experts": solved.items, "sources": dict(sorted(solved.sources.items())),
                   "matrices_kept_search": solved.kept}
        writer = ShardWriter(self.directory / layer_stats_name(layer),
                             metadata={"layer": str(layer), _OUTCOME_KEY: json.dumps(outcome)})
        self._wait_for_write()
        for name, tensor in solved.tensors.items():
            writer.add(name, tensor)  # on the host from here (ShardWriter.add)
        self.directory.mkdir(parents=True, exist_ok=True)
        if self._writer_thread is None:
            self._writer_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fused-staging")
        self._in_flight = self._writer_thread.submit(writer.commit)

    def _wait_for_write(self) -> None:
        """The staged layer in flight, written and recorded (a write error is raised here, in the layer loop)."""
        if self._in_flight is not None:
            future, self._in_flight = self._in_flight, None
            written = future.result()
            self._files[written.file] = written.sha256

    @property
    def files(self) -> dict[str, str]:
        """Staging file -> sha256 of every staged layer; waits for the one in flight (the resume snapshot and
        finalize read this, so neither records a layer whose file is not complete)."""
        self._wait_for_write()
        return self._files

    @files.setter
    def files(self, value: dict[str, str]) -> None:
        self._wait_for_write()
        self._files = value

    def record(self) -> dict[str, Any]:
        return {"method": self.method, "propagation": self.propagation, "batch_experts": self.batch_experts,
                "group_experts": self.group_experts,
                "seconds_per_layer": self.seconds, "statistics_on_disk":
                self.keep_stats_dir is not None, "layers": len(self.files)}


class _LayerSolve:
    """One layer's solved expert tensors and outcome, gathered over its expert groups."""

    def __init__(self):
        self.tensors: dict[str, torch.Tensor] = {}
        self.sources: dict[str, int] = {}
        self.kept = 0
        self.items = 0
        self.counts: LayerStatsCounts | None = None

    def add_counts(self, counts: LayerStatsCounts) -> None:
        if self.counts is None:
            self.counts = counts
            return
        for key in ("dense", "diagonal_fallback", "below_diagonal_min", "without_tokens"):
            setattr(self.counts, key, getattr(self.counts, key) + getattr(counts, key))


def _as_bytes(tensors: dict[str, torch.Tensor]) -> bytes:
    """A layer's solved tensors as safetensors bytes (gate and up share their weight_scale_2 tensor: copied)."""
    return safetensors_save({k: v.clone() if v.dim() == 0 else v for k, v in tensors.items()})


__all__ = ["FUSED_DIR", "FUSED_RECORD", "FusedMethodHook", "finalize", "pending_finalize", "require_not_requantized"]
