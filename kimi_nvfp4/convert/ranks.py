"""Convert under torch.distributed (`torchrun ... -m kimi_nvfp4 convert`, `kimi-nvfp4 --gpus N convert`).

The shards are dealt over the ranks; a shard's bytes depend only on its job (CPU and GPU give the same bytes), so
the output is byte-identical whatever the number of ranks. Rank 0 owns the folder: it alone holds the output lock,
checks and prepares the folder (`prepare_output`), records shards in the manifest and writes everything but the
shards at the end.

Resume: rank 0 records its own shards in the manifest as they finish; every other rank records its finished shards
in a hidden journal of its own (`.kimi_nvfp4_rank<R>.journal.json`, rewritten atomically after each shard). Whatever
kills the job, the next run's `prepare_output` folds the journals into the manifest's records and checks each shard
as it checks its own (size, settings digest, stamp or sha256), so no finished shard is converted twice. Journals are
bookkeeping, never published (the publish stage's public copy leaves hidden files out).

Multi-node runs assume a shared filesystem: every rank writes its shards into the same OUTPUT folder.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from ..checkpoint.file_stamps import FileStamp
from ..checkpoint.manifest import ShardRecord
from ..checkpoint.writer import write_bytes_atomic
from ..distributed import RankContext
from ..errors import KimiNvfp4Error, exit_code_for
from .job import ShardResult
from .plan import ShardJob

_JOURNAL = re.compile(r"^\.kimi_nvfp4_rank(\d+)\.journal\.json$")


def journal_name(rank: int) -> str:
    return f".kimi_nvfp4_rank{rank}.journal.json"


def is_journal_name(name: str) -> bool:
    return _JOURNAL.match(name) is not None


class JournalEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")

    record: ShardRecord
    tensor_stats: dict[str, dict[str, Any]] = {}
    stamp: FileStamp | None = None


class RankJournal(BaseModel):
    """The shards one rank finished in the current run (rank > 0; rank 0 writes the manifest itself)."""

    model_config = ConfigDict(extra="forbid")

    rank: int
    shards: dict[str, JournalEntry] = {}


def load_journals(output: Path) -> list[RankJournal]:
    """Every readable journal in `output`, in rank order. An unreadable one is skipped: its shards are then
    converted again (a journal is a cache of finished work, like the stamps)."""
    found = []
    for path in sorted(output.iterdir()):
        if not is_journal_name(path.name):
            continue
        try:
            found.append(RankJournal.model_validate_json(path.read_bytes()))
        except (OSError, ValueError, ValidationError):
            continue
    return sorted(found, key=lambda j: j.rank)


def remove_journals(output: Path) -> None:
    for path in output.iterdir():
        if is_journal_name(path.name):
            path.unlink(missing_ok=True)


class JournalRecorder:
    """Records each finished shard of a rank > 0 in its journal (same call as the manifest's recorder)."""

    def __init__(self, output: Path, rank: int, settings_sha256: str, *, durable: bool):
        self.output, self.durable, self.settings_sha256 = output, durable, settings_sha256
        self.journal = RankJournal(rank=rank)
        self.path = output / journal_name(rank)

    def __call__(self, result: ShardResult) -> None:
        w = result.written
        record = ShardRecord(file=w.file, sha256=w.sha256, bytes=w.bytes, tensors=w.tensors, durable=self.durable,
                             settings_sha256=self.settings_sha256)
        self.journal.shards[w.file] = JournalEntry(record=record, tensor_stats=result.tensor_stats,
                                                   stamp=FileStamp.of(self.output / w.file))
        data = json.dumps(self.journal.model_dump(mode="json"), indent=1, sort_keys=True) + "\n"
        write_bytes_atomic(self.path, data.encode(), durable=self.durable)


def assign_jobs(jobs: list[ShardJob], world_size: int) -> list[list[ShardJob]]:
    """Each rank's jobs: the largest shard first to the rank with the fewest bytes so far (ties: the lower rank),
    each rank's list then in plan order. Deterministic, so every rank computes the same split."""
    loads = [0] * world_size
    owner: dict[str, int] = {}
    for job in sorted(jobs, key=lambda j: (-j.input_bytes, j.file)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        owner[job.file] = rank
        loads[rank] += job.input_bytes
    return [[j for j in jobs if owner[j.file] == r] for r in range(world_size)]


class RankFailure(KimiNvfp4Error):
    """Another rank's error, raised on every rank with that error's exit code (the job fails as that rank did)."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


def failure_of(error: BaseException | None) -> tuple[int, str] | None:
    """What other ranks need to know of this rank's error (exceptions do not all survive pickling)."""
    if error is None:
        return None
    return exit_code_for(error), f"{type(error).__name__}: {error}"


def raise_first_failure(ctx: RankContext, failures: list[tuple[int, str] | None], own: BaseException | None) -> None:
    """After every rank reported: re-raise this rank's own error, else the lowest failing rank's."""
    if own is not None:
        raise own
    for rank, failure in enumerate(failures):
        if failure is not None:
            code, message = failure
            raise RankFailure(f"rank {rank} of {ctx.world_size} failed: {message}", code)
