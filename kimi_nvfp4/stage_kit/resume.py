"""Resume snapshots of the model stages: a killed calibrate or validate continues after the last layer every rank
had snapshotted, single-process or under torchrun alike.

Layout, under the stage's output (`ResumeStore.stage_dir`):

    .kimi_nvfp4_resume/<stage>/
        complete.json                  rank 0: the layer EVERY rank has a snapshot of (written after a barrier)
        rank<R>/layer_<LLL>/           rank R's snapshot after layer LLL:
            tensors.safetensors        its hidden-state streams, one tensor per sequence, and state tensors
            state.json                 the run's fingerprint, the layer, the stage's small state (a pydantic model)

Writing one (`save`): every rank writes `rank<R>/.layer_<LLL>.partial/` tensor by tensor (the streaming shard
writer: no second copy of the states in memory), fsyncs the files and the folder, renames it to `layer_<LLL>`;
once every rank has (an all-gather of outcomes), rank 0 rewrites `complete.json` atomically; after a second barrier
each rank deletes its older snapshot. A kill at any point leaves `complete.json` naming a layer whose snapshots all
exist, so a resume never mixes layers. A snapshot that cannot be written (disk full) is dropped on every rank with
a logged warning and the run continues without further snapshots: they are an optimisation, not an output.

Reading one (`load`): `complete.json`, then this rank's `state.json`, whose fingerprint must equal the current
run's (checkpoint identity, result-changing options, this rank's token ids, world size and rank). Only when every
rank's check passes is the snapshot used; otherwise every rank starts from layer 0, the reasons are logged and the
stale snapshots deleted. On success the stage calls `finish`, which deletes them.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, TypeVar

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from safetensors import safe_open

from ..checkpoint.writer import StreamingShardWriter, TensorSpec, write_json_atomic
from ..distributed import RankContext
from ..errors import OutputError

log = logging.getLogger(__name__)

RESUME_DIR = ".kimi_nvfp4_resume"
RECORD_NAME = "complete.json"
STATE_NAME = "state.json"
TENSORS_NAME = "tensors.safetensors"
SNAPSHOT_FORMAT = 1
# Layers between snapshots when not given (see docs/calibrate.md "Resume"): at K2.6 scale one snapshot writes
# 15 GB per hidden-state stream (512 x 2048 tokens x 7168 x 2 bytes); a kill loses at most 10 layers.
DEFAULT_RESUME_EVERY = 10
# ...and snapshots may take at most this fraction of the run's time so far: the H200 host's disk wrote a snapshot
# at 0.65 GB/s (docs/benchmarks.md §10, bench.speed.resume_snapshot), so validate's four streams take ~93 s at K2.6
# scale against ~23 s of compute per layer; every 10th layer would add ~40%. After the first snapshot (which
# measures the write time), a due snapshot is skipped while the snapshots' seconds plus one more would exceed it.
DEFAULT_RESUME_MAX_OVERHEAD = 0.1
_STREAM_SEP = "/"


def resume_every_field(folder: str) -> Any:
    """The `resume_every` option of a model stage whose snapshots live under `folder` (its output)."""
    return Field(
        DEFAULT_RESUME_EVERY, ge=0,
        description=f"Snapshot the run every N layers under {folder}/{RESUME_DIR}, so that a killed run continues "
                    "from the last snapshot (a matching one is always used); 0: none. Each costs 15 GB per "
                    "hidden-state stream at K2.6 scale (512 x 2048 tokens).")


def resume_max_overhead_field() -> Any:
    """The `resume_max_overhead` option of a model stage (see `ResumeStore.due`)."""
    return Field(
        DEFAULT_RESUME_MAX_OVERHEAD, gt=0,
        description="Skip a due snapshot while the snapshots would take more than this fraction of the run's time "
                    "so far (measured from the first snapshot's write time; a slow disk then snapshots less often).")

StateT = TypeVar("StateT", bound=BaseModel)


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format: int
    stage: str
    layer: int
    world_size: int


class _SnapshotFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format: int
    layer: int
    fingerprint: dict[str, Any]
    tensors_bytes: int
    state: dict[str, Any]


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _layer_dir_name(layer: int) -> str:
    return f"layer_{layer:03d}"


def fingerprint_differences(recorded: Any, current: Any, path: str = "") -> list[str]:
    """Where two fingerprints differ, as dotted keys with both values where short (for the log)."""
    if isinstance(recorded, dict) and isinstance(current, dict):
        out = []
        for key in sorted(set(recorded) | set(current)):
            out += fingerprint_differences(recorded.get(key), current.get(key), f"{path}.{key}" if path else key)
        return out
    if recorded == current:
        return []
    shown = f"{recorded!r} -> {current!r}" if len(repr(recorded)) + len(repr(current)) < 120 else "changed"
    return [f"{path}: {shown}"]


@dataclass
class Snapshot:
    """One rank's snapshot: the last finished layer, the stage's small state, and its tensors on disk."""

    layer: int
    state: dict[str, Any]
    path: Path

    def parse(self, model: type[StateT]) -> StateT:
        return model.model_validate(self.state)

    def stream(self, name: str, device: torch.device | str, dtype: torch.dtype | None = None) -> list[torch.Tensor]:
        """The per-sequence tensors of stream `name`, in sequence order, each read and moved on its own."""
        prefix = name + _STREAM_SEP
        out = []
        with safe_open(str(self.path / TENSORS_NAME), framework="pt") as f:
            keys = sorted(k for k in f.keys() if k.startswith(prefix))
            for key in keys:
                t = f.get_tensor(key)
                out.append(t.to(device=device, dtype=dtype or t.dtype))
        return out

    def tensors(self, group: str) -> Iterator[tuple[str, torch.Tensor]]:
        """(name within `group`, tensor) of a tensor group written with `save(..., tensors={group: ...})`."""
        prefix = group + _STREAM_SEP
        with safe_open(str(self.path / TENSORS_NAME), framework="pt") as f:
            for key in f.keys():
                if key.startswith(prefix):
                    yield key[len(prefix):], f.get_tensor(key)


class ResumeStore:
    """Snapshots of one stage's run under `root` (its output folder), for this rank of `ctx`.

    :param root: the folder the stage writes (calibrate: the checkpoint; validate: the report folder).
    :param stage: "calibrate" or "validate".
    :param fingerprint: JSON-able description of everything that decides the results (see module doc).
    :param every: write a snapshot after every `every`-th finished layer; 0: never (an existing one is still read).
    """

    def __init__(self, root: str | Path, stage: str, ctx: RankContext, fingerprint: dict[str, Any], every: int,
                 max_overhead: float = DEFAULT_RESUME_MAX_OVERHEAD):
        if every < 0:
            raise ValueError(f"resume interval must be >= 0 layers, got {every}")
        if max_overhead <= 0:
            raise ValueError(f"the snapshots' share of the run time must be > 0, got {max_overhead}")
        self.stage = stage
        self.stage_dir = Path(root) / RESUME_DIR / stage
        self.rank_dir = self.stage_dir / f"rank{ctx.rank}"
        self.ctx = ctx
        # a round trip through JSON, so that it compares equal to what state.json gives back
        self.fingerprint = json.loads(json.dumps(fingerprint, sort_keys=True))
        self.every = every
        self.max_overhead = max_overhead
        self.written: list[int] = []  # layers this run snapshotted (tests, logs)
        self.skipped: list[int] = []  # due snapshots skipped to keep within max_overhead
        self._started = time.perf_counter()
        self._snapshot_seconds = 0.0  # spent writing snapshots so far
        self._last_write: float | None = None  # seconds the last snapshot took

    # --- when --------------------------------------------------------------------------------------
    def due(self, done: int, total: int) -> bool:
        """Whether to snapshot after `done` of `total` layers of this run are finished (collective when the
        interval says yes: rank 0's clock decides for every rank). Never after the last layer (what is left then
        is cheap next to writing every stream), and not while one more snapshot would take the snapshots past
        `max_overhead` of the run's time so far."""
        if not (self.every > 0 and done < total and done % self.every == 0):
            return False
        within = True
        if self._last_write is not None:
            elapsed = time.perf_counter() - self._started
            within = self._snapshot_seconds + self._last_write <= self.max_overhead * elapsed
        if self.ctx.distributed:
            within = self.ctx.broadcast_object(within)
        if not within:
            self.skipped.append(done)
            log.info("%s: snapshot after %d layers skipped: snapshots took %.1f s, the last %.1f s, over %.0f%% of "
                     "%.1f s", self.stage, done, self._snapshot_seconds, self._last_write, 100 * self.max_overhead,
                     time.perf_counter() - self._started)
        return within

    # --- write -------------------------------------------------------------------------------------
    def save(
        self,
        layer: int,
        state: BaseModel,
        streams: dict[str, list[torch.Tensor]],
        tensors: dict[str, dict[str, torch.Tensor]] | None = None,
    ) -> bool:
        """Snapshot this rank after `layer` (collective: every rank calls it after the same layer).

        :param state: the stage's small state: a pydantic model stored as JSON, with `ser_json_inf_nan="constants"`
            (an infinite or NaN figure must come back as itself, not as null).
        :param streams: hidden-state streams, each a list of per-sequence tensors (written one by one).
        :param tensors: named groups of further tensors (e.g. calibrate's input scales).
        :returns: whether every rank's snapshot was written and recorded.
        """
        if state.model_config.get("ser_json_inf_nan") != "constants":
            raise ValueError(f"{type(state).__name__} must set ser_json_inf_nan='constants' to be snapshotted")
        final = self.rank_dir / _layer_dir_name(layer)
        ok = True
        started = time.perf_counter()
        try:
            self._write(final, layer, state, streams, tensors or {})
        except (OutputError, OSError) as e:
            ok = False
            log.warning("%s: cannot write the resume snapshot after layer %d (%s); continuing without snapshots",
                        self.stage, layer, e)
        ok = all(self.ctx.all_gather_object(ok))  # also the barrier: every rank's snapshot is on disk
        if ok and self.ctx.is_main:
            record = _Record(format=SNAPSHOT_FORMAT, stage=self.stage, layer=layer, world_size=self.ctx.world_size)
            try:
                write_json_atomic(self.stage_dir / RECORD_NAME, record.model_dump())
            except OutputError as e:  # the previous record (and its snapshots) stand
                ok = False
                log.warning("%s: cannot record the resume snapshot after layer %d (%s); continuing without "
                            "snapshots", self.stage, layer, e)
        if not self.ctx.broadcast_object(ok):  # rank 0's word: the record names `layer`, or nothing changed
            for path in (final, final.with_name(f".{final.name}.partial")):
                shutil.rmtree(path, ignore_errors=True)
            self.every = 0
            return False
        self._remove_others(keep=final.name)  # the older snapshots are no longer needed
        self.written.append(layer)
        self._last_write = time.perf_counter() - started
        self._snapshot_seconds += self._last_write
        return True

    def _write(self, final: Path, layer: int, state: BaseModel, streams: dict[str, list[torch.Tensor]],
               tensors: dict[str, dict[str, torch.Tensor]]) -> None:
        partial = final.with_name(f".{final.name}.partial")
        shutil.rmtree(partial, ignore_errors=True)
        shutil.rmtree(final, ignore_errors=True)  # an unrecorded snapshot of an earlier run at the same layer
        partial.mkdir(parents=True)
        items: list[tuple[str, torch.Tensor]] = []
        for name, seqs in streams.items():
            width = max(6, len(str(len(seqs))))
            items += [(f"{name}{_STREAM_SEP}{i:0{width}d}", t) for i, t in enumerate(seqs)]
        for group, named in tensors.items():
            items += [(f"{group}{_STREAM_SEP}{n}", t) for n, t in sorted(named.items())]
        specs = [TensorSpec(n, t.dtype, tuple(t.shape)) for n, t in items]
        # checked by size on load (fsync + rename make a torn file impossible): no sha256 to cap the write rate
        with StreamingShardWriter(partial / TENSORS_NAME, specs, {"layer": str(layer)}, checksum=False) as writer:
            for n, t in items:
                writer.write(n, t)
            written = writer.commit()
        snapshot = _SnapshotFile(
            format=SNAPSHOT_FORMAT, layer=layer, fingerprint=self.fingerprint, tensors_bytes=written.bytes,
            state=json.loads(state.model_dump_json()),
        )
        write_json_atomic(partial / STATE_NAME, snapshot.model_dump())
        _fsync_dir(partial)
        os.replace(partial, final)
        _fsync_dir(self.rank_dir)

    def _remove_others(self, keep: str) -> None:
        if not self.rank_dir.is_dir():
            return
        for p in self.rank_dir.iterdir():
            if p.name != keep:
                shutil.rmtree(p, ignore_errors=True)

    # --- read --------------------------------------------------------------------------------------
    def _check(self) -> tuple[str | None, Snapshot | None]:
        """(None, this rank's snapshot) when it may be used, else (why not, None); ("", None): nothing there."""
        record_path = self.stage_dir / RECORD_NAME
        if not record_path.is_file():
            return "", None
        try:
            record = _Record.model_validate_json(record_path.read_text())
        except (OSError, ValueError, ValidationError) as e:
            return f"unreadable {record_path} ({e})", None
        if record.format != SNAPSHOT_FORMAT or record.stage != self.stage:
            return f"{record_path} is of another format or stage", None
        if record.world_size != self.ctx.world_size:
            return f"written by {record.world_size} ranks, this run has {self.ctx.world_size}", None
        folder = self.rank_dir / _layer_dir_name(record.layer)
        try:
            snap = _SnapshotFile.model_validate_json((folder / STATE_NAME).read_text())
        except (OSError, ValueError, ValidationError) as e:
            return f"rank {self.ctx.rank}: no readable snapshot of layer {record.layer} ({e})", None
        if snap.format != SNAPSHOT_FORMAT or snap.layer != record.layer:
            return f"rank {self.ctx.rank}: {folder} is not the recorded snapshot", None
        if snap.fingerprint != self.fingerprint:
            changed = "; ".join(fingerprint_differences(snap.fingerprint, self.fingerprint))
            return f"rank {self.ctx.rank}: the run differs from the snapshot's ({changed})", None
        tensors = folder / TENSORS_NAME
        size = tensors.stat().st_size if tensors.is_file() else -1
        if size != snap.tensors_bytes:
            return f"rank {self.ctx.rank}: {tensors} has {size} bytes, {snap.tensors_bytes} were written", None
        return None, Snapshot(layer=snap.layer, state=snap.state, path=folder)

    def load(self) -> Snapshot | None:
        """This rank's snapshot when every rank has a usable one of the recorded layer (collective), else None
        (reasons logged, stale snapshots deleted)."""
        reason, snapshot = self._check()
        reasons = self.ctx.all_gather_object(reason)
        if all(r is None for r in reasons):
            self._remove_others(keep=snapshot.path.name)
            log.warning("%s: resuming after layer %d from %s", self.stage, snapshot.layer, self.stage_dir)
            return snapshot
        found = [r for r in reasons if r]
        if found and self.ctx.is_main:
            log.warning("%s: resume snapshot ignored, starting from layer 0: %s", self.stage, " | ".join(found))
        self.ctx.barrier()  # nobody reads the folder any more
        if self.ctx.is_main:
            shutil.rmtree(self.stage_dir, ignore_errors=True)
        self.ctx.barrier()
        return None

    def finish(self) -> None:
        """The stage succeeded: delete its snapshots (rank 0, after the stage's own final barrier)."""
        if self.ctx.is_main:
            # the record first: a kill in the middle leaves snapshots no run will try to use, deleted at its start
            (self.stage_dir / RECORD_NAME).unlink(missing_ok=True)
            shutil.rmtree(self.stage_dir, ignore_errors=True)
            parent = self.stage_dir.parent
            if parent.is_dir() and not any(parent.iterdir()):
                parent.rmdir()
