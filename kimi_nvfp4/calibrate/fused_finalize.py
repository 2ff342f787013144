"""The last step of `calibrate --method` (calibrate/fused_method.py): the staged layers written into the shards, and
its resume after a kill.

`finalize` first checks every staging file against the sha256 the layer loop recorded, then writes
`pending_finalize.json` into the staging folder (the staging file -> sha256 map, the method and its options), records
the requantize stage as incomplete (`settings.fused`, statistics mode "in-memory"), rewrites the routed-expert shards
one by one (each recorded as requantize records it), marks the stage complete and deletes the staging folder.

Started again on that output, calibrate asks `pending_finalize` what is left:
- no requantize stage: nothing (a fresh run; a kill while the staging files were checked ends here too);
- a fused requantize stage not complete: `finalize` again from the staging files that pending_finalize.json names
  (checked against their digests); the input scales and the report were written before finalize started, so the
  layer loop is skipped, and rewriting a shard already rewritten gives the same bytes;
- a fused requantize stage complete while the staging folder is still there (killed while deleting it): only the
  deletion;
- anything else (a standalone requantize, a finished fused run, the record or a staging file missing or changed, the
  method, its options or calibrate's settings not the interrupted run's): CheckpointError naming the file.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError
from safetensors import safe_open

from ..checkpoint.reader import CheckpointReader
from ..checkpoint.writer import sha256_file, write_bytes_atomic
from ..errors import CheckpointError
from .expert_stats_file import layer_stats_name

FUSED_DIR = "fused_experts"  # under OUTPUT/calibration: per-layer staging of the requantized expert tensors
FUSED_RECORD = "fused_method"  # key in stages.calibrate.outputs
STATISTICS_MODE = "in-memory"  # the requantize record's statistics_mode for fused runs
PENDING_NAME = "pending_finalize.json"  # in the staging folder, from the start of finalize until it is deleted
OUTCOME_KEY = "outcome"  # a staging file's metadata: the layer's solve outcome (JSON)
_REFUSED = ("calibrate --method needs the routed experts as convert wrote them, but requantize already rewrote them "
            "here; convert again into a fresh folder")


class StagedLayers(BaseModel):
    """pending_finalize.json: what an interrupted finalize writes into the shards."""

    model_config = ConfigDict(extra="forbid")

    method: str
    method_options: dict[str, Any]
    files: dict[str, str]  # staging file (name in the staging folder) -> sha256


@dataclass
class PendingFinalize:
    """What a killed finalize left to do (`pending_finalize`)."""

    directory: Path  # the staging folder
    staged: StagedLayers | None  # None: every shard rewritten and recorded, only the staging folder left to delete

    def finish(self, output: Path) -> None:
        if self.staged is None:
            shutil.rmtree(self.directory, ignore_errors=True)
        else:
            finalize(output, self.directory, self.staged.files, self.staged.method, self.staged.method_options)


def _canonical(value: Any) -> Any:
    return json.loads(json.dumps(value, sort_keys=True))


def require_not_requantized(output: Path) -> None:
    """calibrate --method observes the experts as convert wrote them: refuse a checkpoint whose expert shards a
    requantize (or a finished fused run) already rewrote."""
    from ..checkpoint.manifest import load_manifest
    from ..requantize.record import REQUANTIZE_STAGE

    if REQUANTIZE_STAGE in load_manifest(output).stages:
        raise CheckpointError(_REFUSED, file=output / "kimi_nvfp4_manifest.json")


def pending_finalize(output: Path, method: str, method_options: dict[str, Any],
                     calibrate_settings: dict[str, Any]) -> PendingFinalize | None:
    """None where calibrate --method may run its layer loop (no requantize stage recorded); what is left of a fused
    run killed during `finalize` when this invocation repeats it (`calibrate_settings`: what the calibrate stage
    would record); else CheckpointError (module docstring)."""
    from ..checkpoint.manifest import MANIFEST_NAME, load_manifest
    from ..requantize.record import REQUANTIZE_STAGE

    manifest_path = output / MANIFEST_NAME
    manifest = load_manifest(output)
    stage = manifest.stages.get(REQUANTIZE_STAGE)
    if stage is None:
        return None
    directory = output / "calibration" / FUSED_DIR
    calibrate = manifest.stages.get("calibrate")
    fused = (stage.settings.get("fused") is True and stage.outputs.get("statistics_mode") == STATISTICS_MODE
             and calibrate is not None and FUSED_RECORD in calibrate.outputs)
    if not fused or (stage.complete and not directory.is_dir()):
        raise CheckpointError(_REFUSED, file=manifest_path)
    if stage.complete:  # killed while deleting the staging folder
        staged, recorded_in = None, manifest_path
        recorded = (stage.settings.get("method"), stage.settings.get("method_options"))
    else:
        staged, recorded_in = _load_staged(directory / PENDING_NAME), directory / PENDING_NAME
        recorded = (staged.method, staged.method_options)
    if (recorded[0], _canonical(recorded[1])) != (method, _canonical(method_options)):
        raise CheckpointError(f"calibrate --method {method} with options {method_options}: the interrupted run here "
                              f"used --method {recorded[0]} with options {recorded[1]}; run the same command again "
                              "to finish it", file=recorded_in)
    differ = sorted(k for k in set(calibrate.settings) | set(calibrate_settings)
                    if _canonical(calibrate.settings.get(k)) != _canonical(calibrate_settings.get(k)))
    if differ:
        raise CheckpointError(f"a calibrate --method run killed while writing its staged layers into the shards "
                              f"recorded other settings ({', '.join(differ)}); run the same command again to finish "
                              "it, or convert again into a fresh folder", file=manifest_path)
    return PendingFinalize(directory, staged)


def _load_staged(path: Path) -> StagedLayers:
    try:
        return StagedLayers.model_validate_json(path.read_text())
    except (OSError, ValidationError, ValueError):
        raise CheckpointError("the requantize stage of an interrupted calibrate --method is recorded, but not the "
                              "staged layers it was writing (missing or malformed); convert again into a fresh "
                              "folder", file=path) from None


def _staged(directory: Path, files: dict[str, str]) -> tuple[dict[str, Path], dict[str, dict[str, Any]]]:
    """Tensor name -> staging file, and each file's outcome; every file checked against its recorded sha256."""
    where, outcomes = {}, {}
    for name, digest in sorted(files.items()):
        path = directory / name
        if not path.is_file() or sha256_file(path) != digest:
            raise CheckpointError("a staged requantized layer is missing or changed (run calibrate --method again "
                                  "on a fresh conversion)", file=path)
        with safe_open(str(path), framework="pt") as f:
            outcomes[name] = json.loads((f.metadata() or {})[OUTCOME_KEY])
            for tensor in f.keys():
                where[tensor] = path
    return where, outcomes


def finalize(output: Path, directory: Path, files: dict[str, str], method: str,
             method_options: dict[str, Any]) -> None:
    """Rewrite every routed-expert shard from the staging files, record them as requantize does (a shard at a time),
    then delete the staging files; a kill here is resumed by `pending_finalize` (module docstring)."""
    from ..checkpoint.manifest import ShardRecord, conversion_sha256, load_manifest
    from ..requantize.api import _save_progress
    from ..requantize.record import RequantizedShard, RequantizeRecord, requantized_sha256
    from ..requantize.shard import expert_inputs_in, replace_in_shard

    where, outcomes = _staged(directory, files)
    reader = CheckpointReader(output)
    manifest = load_manifest(output)
    conversion = conversion_sha256(manifest.settings, manifest.source.fingerprint)
    record = RequantizeRecord(method=method, statistics_mode=STATISTICS_MODE)
    settings = {"method": method, "recalibrate": False, "method_options": method_options, "fused": True}
    # what a rerun needs to finish this from the staging files, written before the stage is recorded
    staged = StagedLayers(method=method, method_options=method_options, files=files)
    write_bytes_atomic(directory / PENDING_NAME, (staged.model_dump_json(indent=2) + "\n").encode())
    # recorded before the first shard is rewritten: a kill after a rename but before that shard's record must not
    # leave a folder taken for convert's (a rerun would observe requantized experts); it resumes here instead
    _save_progress(output, manifest, record, settings, complete=False)
    for file in [f for f in reader.shard_files if expert_inputs_in(reader, f)]:
        layers = sorted({item.layer for item in expert_inputs_in(reader, file)})
        used = {f"calibration/{FUSED_DIR}/{layer_stats_name(layer)}": files[layer_stats_name(layer)]
                for layer in layers if layer_stats_name(layer) in files}
        names = [n for n in reader.shard_tensors(file) if n in where]
        replacements = {}
        for path in sorted({where[n] for n in names}):
            with safe_open(str(path), framework="pt") as f:
                replacements.update({n: f.get_tensor(n) for n in names if where[n] == path})
        w = replace_in_shard(output / file, replacements)
        manifest.shards[file] = ShardRecord(file=w.file, sha256=w.sha256, bytes=w.bytes, tensors=w.tensors,
                                            settings_sha256=requantized_sha256(method, used, conversion,
                                                                               method_options))
        layer_outcomes = [outcomes[layer_stats_name(layer)] for layer in layers if layer_stats_name(layer) in files]
        sources: dict[str, int] = {}
        for o in layer_outcomes:
            for key, n in o["sources"].items():
                sources[key] = sources.get(key, 0) + n
        record.shards[file] = RequantizedShard(
            sha256=w.sha256, method=method, statistics=used, experts=sum(o["experts"] for o in layer_outcomes),
            sources=dict(sorted(sources.items())), method_options=method_options,
            matrices_kept_search=sum(o["matrices_kept_search"] for o in layer_outcomes))
        _save_progress(output, manifest, record, settings, complete=False)
    _save_progress(output, manifest, record, settings, complete=True)
    shutil.rmtree(directory, ignore_errors=True)


__all__ = ["FUSED_DIR", "FUSED_RECORD", "PENDING_NAME", "STATISTICS_MODE", "PendingFinalize", "StagedLayers",
           "finalize", "pending_finalize", "require_not_requantized"]
