"""`requantize_checkpoint`: rewrite a calibrated checkpoint's routed experts with an output-aware scale method.

Pipeline order (docs/requantize.md): convert (int4-aware) -> calibrate with `--expert-stats` (input scales and
the experts' input statistics) -> requantize (this) -> input scales recomputed. Steps:

1. checks: OUTPUT is a converted checkpoint of SOURCE, calibrate finished and recorded statistics of the kind
   the method needs, and every statistics file still has the sha256 calibrate recorded;
2. per shard that holds routed-expert weights, in name order: skip it if the manifest records it finished with
   the same method and statistics and its bytes are unchanged; else rewrite it (`shard.rewrite_shard`, atomic)
   and save the manifest (the shard's new digest, the record of what produced it) before the next shard;
3. recalibrate (unless `recalibrate=False`): the input scales are activation maxima, and the activations
   change with the weights (down_proj reads silu(gate x) * up x of the new gate/up weights; every later layer
   reads hidden states the new experts produced under W4A4), so calibration runs again with the settings it
   recorded, writing only the input-scale shard; calibrate's record keeps its statistics entry.
4. validate, serve-check and publish records are dropped: their verdicts judged other bytes.

Shards without routed experts are never opened for writing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from ..calibrate.expert_stats import ExpertStatsMode
from ..calibrate.expert_stats_file import LayerStatsFile
from ..calibrate.expert_stats_hook import EXPERT_STATS_RECORD
from ..calibrate.shard import CALIBRATE_STAGE, DEPENDENT_STAGES
from ..checkpoint.manifest import (
    ConversionManifest,
    ShardRecord,
    StageRecord,
    conversion_sha256,
    load_manifest,
    save_manifest,
)
from ..checkpoint.output_lock import holds_output_lock
from ..checkpoint.reader import CheckpointReader
from ..checkpoint.writer import sha256_file
from ..errors import CheckpointError
from ..numerics.methods import method_spec
from ..stage_kit.device import resolve_device
from ..stage_kit.output_paths import require_writable_dir
from ..stage_kit.pairing import require_converted, require_matching_source
from .options import STATS_MODES_FOR, OutputAwareMethod, RequantizeOptions
from .record import REQUANTIZE_STAGE, RequantizeRecord, RequantizedShard, requantized_sha256
from .shard import expert_inputs_in, rewrite_shard

# The recalibration's report goes beside calibrate's own, which it must not overwrite.
RECALIBRATION_REPORT_DIR = "calibration/after_requantize"


@dataclass
class RequantizeResult:
    method: str
    shards_rewritten: list[str] = field(default_factory=list)
    shards_skipped: list[str] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)  # experts per statistics source, matrices kept
    recalibrated: bool = False
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"method": self.method, "shards_rewritten": len(self.shards_rewritten),
                "shards_skipped": len(self.shards_skipped), "recalibrated": self.recalibrated,
                "seconds": self.seconds, **self.counts}


def _calibrate_record(output: Path, manifest: ConversionManifest, method: str) -> tuple[StageRecord, dict[str, Any]]:
    """calibrate's record and its statistics entry, checked against what `method` needs."""
    record = manifest.stages.get(CALIBRATE_STAGE)
    if record is None or not record.complete:
        raise CheckpointError("calibrate has not finished on this checkpoint; run `kimi-nvfp4 calibrate "
                              "--expert-stats ...` first", file=output / "kimi_nvfp4_manifest.json")
    stats = record.outputs.get(EXPERT_STATS_RECORD)
    need = method_spec(method).statistics
    allowed = STATS_MODES_FOR[need]
    if stats is None or ExpertStatsMode(stats.get("mode", "none")) not in allowed:
        have = "none" if stats is None else stats.get("mode")
        raise CheckpointError(
            f"requantize --method {method} needs calibrate --expert-stats {' or '.join(m.value for m in allowed)}; "
            f"calibrate recorded {have}", file=output / "kimi_nvfp4_manifest.json")
    return record, stats


class _StatsFiles:
    """The statistics files calibrate recorded, each checked against its sha256 when first used."""

    def __init__(self, output: Path, entry: dict[str, Any]):
        self.folder = output / entry["dir"]
        self.digests: dict[str, str] = dict(entry["files"])
        self.prefix = entry["dir"]
        self._open: dict[int, LayerStatsFile] = {}
        self._checked: set[str] = set()

    def name(self, layer: int) -> str:
        return f"layer_{layer:03d}.safetensors"

    def recorded(self, layers: set[int]) -> dict[str, str]:
        """`dir/file -> sha256` for these layers (what a shard's record names)."""
        out = {}
        for layer in sorted(layers):
            name = self.name(layer)
            if name not in self.digests:
                raise CheckpointError(f"calibrate recorded no expert statistics for layer {layer}",
                                      file=self.folder / name)
            out[f"{self.prefix}/{name}"] = self.digests[name]
        return out

    def __call__(self, layer: int) -> LayerStatsFile:
        """The layer's file (one kept open: shards hold consecutive layers), its sha256 checked on first use."""
        if layer not in self._open:
            name = self.name(layer)
            path = self.folder / name
            if name not in self._checked:
                if not path.is_file() or sha256_file(path) != self.digests.get(name):
                    raise CheckpointError("expert statistics file is missing or changed since calibrate recorded "
                                          "it (run calibrate again)", file=path)
                self._checked.add(name)
            self._open = {layer: LayerStatsFile(path)}
        return self._open[layer]


def _record_of(manifest: ConversionManifest, method: str, mode: str) -> RequantizeRecord:
    stage = manifest.stages.get(REQUANTIZE_STAGE)
    if stage is not None:
        try:
            record = RequantizeRecord.model_validate(stage.outputs)
            if record.method == method:
                return record
        except ValueError:
            pass  # an unreadable record: start over (every shard is rewritten from the source anyway)
    return RequantizeRecord(method=method, statistics_mode=mode)


def _save_progress(output: Path, manifest: ConversionManifest, record: RequantizeRecord, settings: dict[str, Any],
                   complete: bool) -> None:
    for stage in DEPENDENT_STAGES:
        manifest.stages.pop(stage, None)
    manifest.stages[REQUANTIZE_STAGE] = StageRecord(
        settings=settings, complete=complete, outputs=record.model_dump(mode="json"),
        finished_at=datetime.now(timezone.utc).isoformat(timespec="seconds") if complete else "")
    save_manifest(output, manifest)


@holds_output_lock("requantize", "output")
def requantize_checkpoint(
    output: str | Path,
    source: str | Path,
    options: RequantizeOptions | None = None,
    *,
    progress: bool = True,
    **overrides: Any,
) -> RequantizeResult:
    """Rewrite the routed-expert shards of the calibrated checkpoint `output` with an output-aware method.

    :param output: a converted and calibrated (`--expert-stats`) NVFP4 checkpoint folder; rewritten in place.
    :param source: the INT4 checkpoint it was converted from (the reference the methods quantize against).
    :param options: a `RequantizeOptions`; its fields may also be given as keywords.
    :returns: what was rewritten, skipped and counted (the manifest's `stages.requantize` has it per shard).
    """
    opts = RequantizeOptions.build(options, overrides, "requantize_checkpoint")
    started = time.perf_counter()
    output, source = Path(output), Path(source)
    require_writable_dir(output, what="requantize's output folder")  # before any shard is rewritten
    method = OutputAwareMethod(opts.method).value
    out_reader, src_reader = CheckpointReader(output), CheckpointReader(source)
    require_converted(out_reader)
    require_matching_source(src_reader, out_reader)
    manifest = load_manifest(output)
    calibrate_record, stats_entry = _calibrate_record(output, manifest, method)
    stats = _StatsFiles(output, stats_entry)
    device = resolve_device(opts.device)
    record = _record_of(manifest, method, stats_entry["mode"])
    conversion = conversion_sha256(manifest.settings, manifest.source.fingerprint)
    settings = opts.recorded()
    method_options = settings["method_options"]
    result = RequantizeResult(method)
    files = [f for f in out_reader.shard_files if expert_inputs_in(out_reader, f)]
    for file in files:
        layers = {item.layer for item in expert_inputs_in(out_reader, file)}
        used = stats.recorded(layers)
        shard = manifest.shards.get(file)
        current = shard.sha256 if shard is not None else None
        if record.finished(file, method, used, current, method_options) and sha256_file(output / file) == current:
            result.shards_skipped.append(file)
            continue
        outcome = rewrite_shard(output, file, out_reader, src_reader, stats, method=method, device=device,
                                batch_experts=opts.batch_experts, method_options=method_options)
        w = outcome.written
        manifest.shards[file] = ShardRecord(file=w.file, sha256=w.sha256, bytes=w.bytes, tensors=w.tensors,
                                            settings_sha256=requantized_sha256(method, used, conversion,
                                                                               method_options))
        record.shards[file] = RequantizedShard(sha256=w.sha256, method=method, statistics=used,
                                               experts=outcome.experts, sources=outcome.sources,
                                               matrices_kept_search=outcome.matrices_kept_search,
                                               method_options=method_options)
        record.recalibrated = False
        _save_progress(output, manifest, record, settings, complete=False)
        result.shards_rewritten.append(file)
    if opts.recalibrate and not record.recalibrated:
        _recalibrate(output, source, calibrate_record, opts, progress)
        manifest = load_manifest(output)
        record.recalibrated = True
    result.recalibrated = record.recalibrated
    result.counts = record.counts()
    _save_progress(output, manifest, record, settings, complete=True)
    result.seconds = time.perf_counter() - started
    return result


def _recalibrate(output: Path, source: Path, before: StageRecord, opts: RequantizeOptions, progress: bool) -> None:
    """calibrate again with its recorded settings (no statistics this time: requantize used the recorded ones),
    then give calibrate's record back its statistics entry and settings, so the pipeline still sees calibrate
    complete with the settings it ran with."""
    from ..calibrate import CalibrateOptions, calibrate_checkpoint

    s = before.settings
    options = CalibrateOptions(samples=s["samples"], seq_len=s["seq_len"], seed=s["seed"],
                               min_expert_tokens=s["min_expert_tokens"], policy=s["policy"], device=opts.device,
                               dtype=s.get("dtype", "auto"))
    report = calibrate_checkpoint(output, source, s["data"], options, progress=progress,
                                  report_dir=output / RECALIBRATION_REPORT_DIR, save_activation_stats=False)
    manifest = load_manifest(output)
    after = manifest.stages[CALIBRATE_STAGE]
    after.settings = dict(s)
    after.outputs = {**before.outputs, **after.outputs, EXPERT_STATS_RECORD: before.outputs[EXPERT_STATS_RECORD],
                     "recalibrated_after": REQUANTIZE_STAGE, "report": before.outputs.get("report"),
                     "report_after_requantize": RECALIBRATION_REPORT_DIR}
    after.outputs["sha256"] = report.shard_sha256
    save_manifest(output, manifest)
