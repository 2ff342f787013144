"""The output folder: refuse foreign content, resume our own, finish atomically.

- absent or empty: a fresh conversion;
- holding our manifest with the same settings and source: resume, skipping shards the manifest
  lists as finished (see below);
- holding our manifest with other settings or another source: refused unless `overwrite`, which removes
  what the earlier conversion wrote (its manifest's shards, the files convert writes, the files it copied from
  the source, our hidden files) and KEEPS everything else (notes, results a user added), naming both; with
  `remove_unlisted` (`--overwrite-unlisted`) it empties the folder (only a folder our manifest marks as ours
  is ever emptied);
- holding anything else: always refused.
Our own hidden files never count as foreign content: the folder's lock file and shard stamps, the journals of a
torch.distributed run's other ranks (convert/ranks.py: their shards are folded into the manifest's records and checked
like the rest), and leftover
`.NAME.partial` files of an interrupted run (removed before converting; a run killed while writing its very first
manifest leaves only `.kimi_nvfp4_manifest.json.partial`, and the next run starts afresh).

A recorded shard is reused only when its file is regular, has the recorded size, was written with the same
settings and source (`ShardRecord.settings_sha256`), and is the very file convert wrote (its stamp: device, inode,
size, mtime, `checkpoint/file_stamps.py`) — or, failing the stamp, its recomputed sha256 equals the record. So a
shard replaced by another process with bytes of the same size is converted again instead of trusted.

Shards written without fsync (`--no-fsync`) sit in the page cache until the OS writes them back: a killed
process loses nothing, an OS crash or power loss can. So such a shard is trusted on its stamp only within the
boot that wrote it (the manifest's `boot_id`); after a reboot its sha256 is recomputed first, and a shard that
does not match is converted again.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path

from ..checkpoint.file_stamps import STAMPS_NAME, FileStamp, load_stamps
from ..checkpoint.manifest import (
    MANIFEST_NAME,
    ConversionManifest,
    ShardRecord,
    conversion_sha256,
    current_boot_id,
    load_manifest,
)
from ..checkpoint.output_lock import LOCK_NAME
from ..checkpoint.writer import is_partial_name, sha256_file
from ..errors import CheckpointError, OutputError
from .ranks import is_journal_name, load_journals, remove_journals

# Hidden files of ours that say nothing about whose folder it is (the lock may be taken before the first manifest).
_BOOKKEEPING = frozenset({LOCK_NAME, STAMPS_NAME})


@dataclass
class OutputState:
    manifest: ConversionManifest
    finished: set[str]  # shard files already converted with these settings
    resumed: bool
    was_complete: bool = False  # a finished conversion: later stages may have added files and index entries
    overwrite_removed: list[str] = field(default_factory=list)  # entries --overwrite removed (earlier conversion's)
    overwrite_kept: list[str] = field(default_factory=list)  # entries it kept: not listed by the earlier manifest
    stamps: dict[str, FileStamp] | None = None  # recorded stamps of the finished shards


def _remove(path: Path) -> None:
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    except OSError as e:
        raise OutputError(f"file {path}: cannot remove it ({e.strerror or e})") from None


# Files convert writes itself besides the manifest's shards (convert/api.py _finish, calibrate's scheme switch)
_CONVERT_WRITES = frozenset({MANIFEST_NAME, "model.safetensors.index.json", "config.json", "hf_quant_config.json",
                             ".kimi-nvfp4-scheme-switch.json"})


def _listed(name: str, previous: ConversionManifest) -> bool:
    """Whether the earlier conversion's manifest accounts for `name`: one of its shards (calibrate's included),
    a file convert writes, a file it copied from the source folder, or our hidden bookkeeping."""
    source = Path(previous.source.path)
    return (name in previous.shards or name in _CONVERT_WRITES or _ours(name)
            or (source.is_dir() and (source / name).is_file()))


def _clear_folder(folder: Path, previous: ConversionManifest, *, remove_unlisted: bool) -> tuple[list[str], list[str]]:
    """Remove the earlier conversion's entries (all entries with `remove_unlisted`); (removed, kept) names."""
    removed, kept = [], []
    for entry in sorted(folder.iterdir()):
        if entry.name == LOCK_NAME:  # other processes wait on this very file (checkpoint/output_lock.py)
            continue
        if remove_unlisted or _listed(entry.name, previous):
            _remove(entry)
            removed.append(entry.name)
        else:
            kept.append(entry.name)
    return removed, kept


def _remove_partials(output: Path, entries: list[str]) -> None:
    for name in entries:
        if is_partial_name(name):
            _remove(output / name)


def _ours(name: str) -> bool:
    return name in _BOOKKEEPING or is_partial_name(name) or is_journal_name(name)


def prepare_output(output: Path, fresh: ConversionManifest, *, overwrite: bool,
                   remove_unlisted: bool = False) -> OutputState:
    if output.exists() and not output.is_dir():
        raise OutputError(f"file {output}: output exists and is not a folder")
    try:
        output.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OutputError(f"file {output}: cannot create the output folder ({e.strerror or e})") from None
    entries = sorted(p.name for p in output.iterdir())
    foreign = [name for name in entries if not _ours(name)]
    if not foreign:
        _remove_partials(output, entries)
        remove_journals(output)  # no manifest: nothing of an earlier run is trusted
        return OutputState(fresh, set(), resumed=False)
    if MANIFEST_NAME not in foreign:
        shown = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
        raise OutputError(
            f"file {output}: output folder holds other content ({len(foreign)} entries: {shown}) and no "
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
        removed, kept = _clear_folder(output, previous, remove_unlisted=remove_unlisted)
        return OutputState(fresh, set(), resumed=False, overwrite_removed=removed, overwrite_kept=kept)
    _remove_partials(output, entries)
    same_boot = previous.boot_id is not None and previous.boot_id == current_boot_id()
    digest = conversion_sha256(fresh.settings, fresh.source.fingerprint)
    stamps = load_stamps(output)
    for journal in load_journals(output):
        # shards other ranks of a torch.distributed run finished (convert/ranks.py): checked like our own below
        for file, entry in journal.shards.items():
            previous.shards.setdefault(file, entry.record)
            previous.tensor_stats.update(entry.tensor_stats)
            if entry.stamp is not None and file not in stamps:
                stamps[file] = entry.stamp
    finished = {
        f for f, rec in previous.shards.items() if _still_finished(output / f, rec, digest, stamps.get(f), same_boot)
    }
    was_complete = previous.complete and finished == set(previous.shards)
    previous.shards = {f: r for f, r in previous.shards.items() if f in finished}
    stamps = {f: s for f, s in stamps.items() if f in finished}
    return OutputState(previous, finished, resumed=True, was_complete=was_complete, stamps=stamps)


def _still_finished(
    path: Path, record: ShardRecord, settings_digest: str, stamp: FileStamp | None, same_boot: bool
) -> bool:
    """The shard `record` describes is on disk whole, and was converted with these settings from this source."""
    now = FileStamp.of(path)
    if now is None or now.size != record.bytes:
        return False
    if record.settings_sha256 is not None and record.settings_sha256 != settings_digest:
        return False  # written by a run with other settings or another source
    if stamp == now and (record.durable or same_boot):
        return True
    return sha256_file(path) == record.sha256
