"""Refusals: publish only a checkpoint whose every shard is complete and intact, and that passed validate.

Shard integrity can never be overridden (a corrupt shard on the Hub is worse than no upload); a missing, stale or
failed validation can, with `force_unvalidated=True`, and the model card then says so in its first lines.
The verdict is the one validate sealed into the manifest (checkpoint/verdict.py): it counts only while the shard
digests it judged equal the manifest's, which this module has just verified against the files. A
`validate_report.json` in the folder or a report folder is never consulted: it may be stale, or copied from a source.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from ..checkpoint.manifest import MANIFEST_NAME, load_manifest
from ..checkpoint.reader import INDEX_NAME
from ..checkpoint.verdict import check_verdict
from ..checkpoint.writer import sha256_file
from ..errors import CheckpointError, GateFailure
from .files import GLOB_CHARACTERS, list_publish_files, partial_files



@dataclass
class Readiness:
    """What the checks found: used by the card (forced flag, validation verdict) and by `--dry-run`."""

    shards_verified: int
    shard_bytes: int
    validation_passed: bool | None  # None: no sealed verdict that holds for these bytes
    validation_source: str | None  # where the verdict was read from
    forced_unvalidated: bool
    notes: list[str] = field(default_factory=list)


def check_shards(folder: Path, manifest: Any, *, workers: int = 4, progress: bool = True) -> tuple[int, int]:
    """Every shard the index names is in the manifest, present, of the recorded size and sha256.

    Returns (shard count, total bytes). Raises CheckpointError naming the first bad file.
    """
    manifest_path = folder / MANIFEST_NAME
    if not manifest.complete:
        raise CheckpointError("the manifest says the conversion is not complete (re-run convert)", file=manifest_path)
    partial = partial_files(folder)
    if partial:
        raise CheckpointError(f"half-written file(s) present: {', '.join(partial)} (a stage is running or crashed)",
                              file=folder)
    shards = {record.file: record for record in manifest.shards.values()}
    index_path = folder / INDEX_NAME
    if index_path.is_file():
        try:
            indexed = set(json.loads(index_path.read_text())["weight_map"].values())
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"index is malformed ({e})", file=index_path) from None
        for file in sorted(indexed - set(shards)):
            raise CheckpointError("the index names this shard but the manifest has no record of it",
                                  file=folder / file)
    for item in list_publish_files(folder):
        if GLOB_CHARACTERS & set(item.path):
            raise CheckpointError("file name contains a glob character (* ? [ ]); rename it", file=folder / item.path)
        if item.path.endswith(".safetensors") and "/" not in item.path and item.path not in shards:
            raise CheckpointError("safetensors file is neither in the manifest nor the index (stray file)",
                                  file=folder / item.path)
    for file, record in sorted(shards.items()):
        path = folder / file
        if path.is_symlink():
            raise CheckpointError("shard recorded in the manifest is a symbolic link; only regular files are "
                                  "published (links are never followed)", file=path)
        if not path.is_file():
            raise CheckpointError("shard recorded in the manifest is missing", file=path)
        size = path.stat().st_size
        if size != record.bytes:
            raise CheckpointError(f"shard has {size} bytes, the manifest records {record.bytes}", file=path)
    total = sum(r.bytes for r in shards.values())
    with tqdm(total=total, unit="B", unit_scale=True, desc="verify sha256", disable=not progress) as bar:
        with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
            names = sorted(shards)
            digests = dict(zip(names, pool.map(lambda f: sha256_file(folder / f, bar), names), strict=True))
    for file, record in sorted(shards.items()):
        if digests[file] != record.sha256:
            raise CheckpointError(f"sha256 {digests[file]} does not match the manifest's {record.sha256} "
                                  "(shard modified or corrupt)", file=folder / file)
    return len(shards), total


def check_publishable(
    folder: str | Path,
    *,
    force_unvalidated: bool = False,
    workers: int = 4,
    progress: bool = True,
) -> Readiness:
    """Refuse (raise) unless the folder is a complete, intact conversion whose sealed validate verdict holds and passed.

    Raises CheckpointError (exit 3) for a missing/incomplete manifest or a bad shard, and GateFailure (exit 1)
    when the verdict is missing, stale or failed and `force_unvalidated` is False.
    """
    root = Path(folder)
    manifest = load_manifest(root)
    count, total = check_shards(root, manifest, workers=workers, progress=progress)
    calibrate = manifest.stages.get("calibrate")
    if calibrate is None or not calibrate.complete:
        # Not overridable: SGLang allocates expert input scales with torch.empty
        # (srt/layers/quantization/modelopt_quant.py, ModelOptNvFp4FusedMoEMethod.create_weights), so a
        # checkpoint without them serves W4A4 with uninitialised scales instead of failing to load.
        raise GateFailure(
            f"{root}: not calibrated (no complete stages.calibrate in the manifest): W4A4 kernels need input_scale; "
            "run `kimi-nvfp4 calibrate` first"
        )
    verdict = check_verdict(root, manifest)
    notes = []
    if verdict.passed is not True:
        if not force_unvalidated:
            raise GateFailure(f"{root}: {verdict.problem}; run `kimi-nvfp4 validate` or pass --force-unvalidated")
        notes.append(f"published with --force-unvalidated: {verdict.problem}")
    source = verdict.source if verdict.verdict is not None else None
    return Readiness(count, total, verdict.passed, source, force_unvalidated and verdict.passed is not True, notes)
