"""calibrate's side of `--expert-stats`: one `ExpertStatsObserver` beside the collector, a file per MoE layer.

`run_calibration` calls `start_layer` before each layer, `observe_done` after its observe pass, `advance_observer`
for its W4A4 advance pass and `finish_layer` after it; the layer's file is written after the pass the mode
records in (observe for diag/hessian, advance for w4a4: expert_stats.py). `record()` is what the
manifest's `stages.calibrate.outputs.expert_stats` holds, the list requantize reads (each file with its sha256,
so a statistics file changed since calibrate wrote it is refused, and each requantized shard names the files
that produced it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..checkpoint.reader import CheckpointReader
from ..model.layer_weights import LayerWeights
from .expert_stats import DOWN, GATE_UP, CollectorWithExpertStats, ExpertStatsMode, ExpertStatsObserver
from .expert_stats_file import LayerStatsCounts, write_layer_stats

EXPERT_STATS_RECORD = "expert_stats"  # key in stages.calibrate.outputs


class ExpertStatsHook:
    """Collects and writes per-expert statistics during `run_calibration` (rank 0 writes)."""

    def __init__(self, mode: ExpertStatsMode, directory: Path):
        self.mode = ExpertStatsMode(mode)
        self.directory = Path(directory)
        self.files: dict[str, str] = {}  # file name -> sha256
        self.counts: list[LayerStatsCounts] = []
        self._observer: ExpertStatsObserver | None = None

    def observer(self, collector: Any, device: torch.device) -> Any:
        """The observe pass's observer: the collector with the expert statistics beside it (just the collector
        when the statistics come from the advance pass)."""
        self._observer = ExpertStatsObserver(self.mode, device)
        return collector if self.mode.quantized else CollectorWithExpertStats(collector, self._observer)

    def start_layer(self, layer: int) -> None:
        self._observer.start_layer(layer)

    def observe_done(self, layer: int, reader: CheckpointReader, ctx: Any, rerun: Any = None) -> None:
        if not self.mode.quantized:
            self._write(layer, reader, ctx)

    def advance_weights(self, source: Any, w: LayerWeights) -> None:
        """The advance pass runs the layer as loaded (FusedMethodHook may swap in solved experts)."""
        return None

    def advance_observer(self, weights: LayerWeights) -> ExpertStatsObserver | None:
        """The advance pass's observer (w4a4 mode: armed with the layer's W4A4 linears), or None."""
        if not self.mode.quantized:
            return None
        self._observer.arm(weights)
        return self._observer

    def finish_layer(self, layer: int, reader: CheckpointReader, ctx: Any) -> None:
        """After the advance pass (or where a layer has none): w4a4 mode writes the layer's file now."""
        if self.mode.quantized:
            self._write(layer, reader, ctx)

    def _write(self, layer: int, reader: CheckpointReader, ctx: Any) -> None:
        cfg = reader.layout.text
        if not cfg.is_moe_layer(layer):
            return
        widths = {GATE_UP: cfg.hidden_size, DOWN: cfg.moe_intermediate_size}
        self._observer.combine_ranks(ctx, widths, cfg.n_routed_experts)
        if ctx.is_main:
            written, counts = write_layer_stats(self.directory, layer, self._observer)
            self.files[written.file] = written.sha256
            self.counts.append(counts)
        self._observer.start_layer(layer)  # free the sums now, not at the next layer

    def record(self, output: Path) -> dict[str, Any]:
        """The manifest entry: the mode, the folder (relative to the output when inside it), files and counts."""
        folder = self.directory
        where = str(folder.relative_to(output)) if folder.is_relative_to(output) else str(folder)
        totals = {key: sum(getattr(c, key) for c in self.counts)
                  for key in ("dense", "diagonal_fallback", "below_diagonal_min", "without_tokens")}
        return {"mode": self.mode.value, "dir": where, "files": dict(sorted(self.files.items())), **totals}
