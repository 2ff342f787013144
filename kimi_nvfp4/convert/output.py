"""The output folder: refuse foreign content, resume our own, finish atomically.

- absent or empty: a fresh conversion;
- holding our manifest with the same settings and source: resume, skipping shards the manifest
  lists as finished (file present with the recorded size);
- holding our manifest with other settings or another source: refused unless `overwrite`, which
  empties the folder first (only a folder our manifest marks as ours is ever emptied);
- holding anything else: always refused.
Leftover `.NAME.partial` files from an interrupted run are removed before resuming.

Shards written without fsync (`--no-fsync`) sit in the page cache until the OS writes them back: a killed
process loses nothing, an OS crash or power loss can. So such a shard is trusted on its size only within the
boot that wrote it (the manifest's `boot_id`); after a reboot its sha256 is recomputed first, and a shard that
does not match is converted again.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from ..checkpoint.manifest import MANIFEST_NAME, ConversionManifest, ShardRecord, current_boot_id, load_manifest
from ..checkpoint.writer import is_partial_name, sha256_file
from ..errors import CheckpointError, OutputError


@dataclass
class OutputState:
    manifest: ConversionManifest
    finished: set[str]  # shard files already converted with these settings
    resumed: bool
    was_complete: bool = False  # a finished conversion: later stages may have added files and index entries


def _clear_folder(folder: Path) -> None:
    for entry in folder.iterdir():
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()


def prepare_output(output: Path, fresh: ConversionManifest, *, overwrite: bool) -> OutputState:
    if output.exists() and not output.is_dir():
        raise OutputError(f"file {output}: output exists and is not a folder")
    output.mkdir(parents=True, exist_ok=True)
    entries = sorted(p.name for p in output.iterdir())
    if not entries:
        return OutputState(fresh, set(), resumed=False)
    if MANIFEST_NAME not in entries:
        shown = ", ".join(entries[:3]) + (", ..." if len(entries) > 3 else "")
        raise OutputError(
            f"file {output}: output folder holds other content ({len(entries)} entries: {shown}) and no "
            f"{MANIFEST_NAME}; choose an empty or new folder"
        )
    try:
        previous = load_manifest(output)
    except CheckpointError as e:
        raise OutputError(f"{e}; refusing to write into a folder whose manifest cannot be read") from None
    same = previous.settings == fresh.settings and previous.source.fingerprint == fresh.source.fingerprint
    if not same:
        if not overwrite:
            raise OutputError(
                f"file {output / MANIFEST_NAME}: output was made with other settings or another source "
                f"(was {previous.settings.model_dump()} from {previous.source.path}); pass --overwrite to replace it"
            )
        _clear_folder(output)
        return OutputState(fresh, set(), resumed=False)
    for name in entries:
        if is_partial_name(name):
            (output / name).unlink()
    same_boot = previous.boot_id is not None and previous.boot_id == current_boot_id()
    finished = {f for f, rec in previous.shards.items() if _still_finished(output / f, rec, same_boot)}
    was_complete = previous.complete and finished == set(previous.shards)
    previous.shards = {f: r for f, r in previous.shards.items() if f in finished}
    return OutputState(previous, finished, resumed=True, was_complete=was_complete)


def _still_finished(path: Path, record: ShardRecord, same_boot: bool) -> bool:
    """The shard `record` describes is on disk whole: its size, and for a shard written without fsync in an
    earlier boot, its sha256."""
    if not path.is_file() or path.stat().st_size != record.bytes:
        return False
    return record.durable or same_boot or sha256_file(path) == record.sha256
