"""Write the shards of a planned synthetic checkpoint, in one process or several.

Every shard's layout is fixed before any byte is generated: tensors in name order, the safetensors header
(the same bytes `ShardWriter` writes) first, then each tensor's data at a known offset. So the header is
written and the file sized up front, and each work unit (one tensor, or the packed weight / scale / shape
of one INT4 matrix, wherever its shards are) is generated and `pwrite`n at its offsets. Units are
independent (contents are seeded per tensor / matrix name), so `workers` processes can write them in any
order and the files are byte-identical to a one-process run. Each process holds one unit (one expert
matrix, or `_GENERATE_ROWS` rows of a BF16 tensor) at a time. Files stay hidden as `.NAME.partial` until
every unit is written and the file fsynced, then are renamed; on any failure they are removed.
"""

from __future__ import annotations

import errno
import multiprocessing
import os
import queue
import threading
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

import torch

from ..checkpoint.writer import TensorSpec as HeaderSpec
from ..checkpoint.writer import _encode_header, partial_path
from ..errors import DeviceError, OutputError
from .tensors import (
    CodeDistribution,
    TensorSpec,
    Workspace,
    WorkUnit,
    unit_chunks,
    work_units,
)

SYNTH_DEVICES = ("cpu", "cuda", "auto")
_METADATA = {"format": "pt"}
# Linux writes at most 0x7ffff000 bytes per call; larger chunks are written in slices.
_MAX_WRITE = 1 << 30


def resolve_synth_device(device: str) -> torch.device:
    """`cpu` (default: the pinned contents), `cuda` (GPU generator: other contents), `auto` (cuda if present)."""
    if device not in SYNTH_DEVICES:
        raise DeviceError(f"synth device must be one of {SYNTH_DEVICES}, got {device!r}")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise DeviceError("synth --device cuda was asked for but torch sees no CUDA device")
    return torch.device(device)


@dataclass(frozen=True)
class ShardLayout:
    path: Path  # the finished file's path
    header: bytes
    size: int  # header + data bytes


@dataclass(frozen=True)
class Task:
    """One unit and, per tensor of it, (partial file path, absolute byte offset of its data)."""

    unit: WorkUnit
    places: dict[str, tuple[str, int]]

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.unit.specs)


def lay_out_shards(out: Path, groups: list[list[TensorSpec]], names: list[str]) -> tuple[list[ShardLayout], list[Task]]:
    """Shard layouts (name-ordered tensors, like ShardWriter) and the tasks writing into them, in plan order."""
    layouts: list[ShardLayout] = []
    places: dict[str, tuple[str, int]] = {}
    for group, name in zip(groups, names, strict=True):
        ordered = sorted(group, key=lambda s: s.name)
        header = _encode_header([HeaderSpec(s.name, s.dtype, s.shape) for s in ordered], _METADATA)
        path = out / name
        offset = len(header)
        for spec in ordered:
            places[spec.name] = (str(partial_path(path)), offset)
            offset += spec.nbytes
        layouts.append(ShardLayout(path, header, offset))
    specs = [s for group in groups for s in group]
    tasks = [Task(u, {s.name: places[s.name] for s in u.specs}) for u in work_units(specs)]
    return layouts, tasks


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    done = 0
    while done < len(data):
        n = os.pwrite(fd, data[done : done + _MAX_WRITE], offset + done)
        if n <= 0:
            raise OSError(errno.EIO, "pwrite wrote nothing")
        done += n


class _BackgroundWrites:
    """`pwrite`s on a thread (it releases the GIL), so disk writes overlap the generation of the next chunk.

    Each chunk is first copied into one of `buffers` host staging buffers (pinned when the chunks come
    from a GPU); `write` waits for a free one, so at most `buffers` chunks wait for the disk.
    """

    def __init__(self, pinned: bool, buffers: int = 2):
        self._pinned = pinned
        self._free: queue.SimpleQueue[torch.Tensor] = queue.SimpleQueue()
        for _ in range(buffers):
            self._free.put(torch.empty(0, dtype=torch.uint8))
        self._jobs: queue.Queue[tuple[int, torch.Tensor, int, torch.Tensor] | None] = queue.Queue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._drain, name="synth-write", daemon=True)
        self._thread.start()

    def _drain(self) -> None:
        while (job := self._jobs.get()) is not None:
            fd, data, offset, buffer = job
            try:
                if self._error is None:
                    _pwrite_all(fd, memoryview(data.numpy()), offset)
            except BaseException as e:  # noqa: BLE001 - re-raised on the producer's side
                self._error = e
            finally:
                self._free.put(buffer)
                self._jobs.task_done()
        self._jobs.task_done()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    def write(self, fd: int, chunk: torch.Tensor, offset: int) -> None:
        self._raise_if_failed()
        nbytes = chunk.numel() * chunk.element_size()
        buffer = self._free.get()
        if buffer.numel() < nbytes:
            buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self._pinned)
        data = buffer[:nbytes]
        data.view(chunk.dtype).view(chunk.shape).copy_(chunk)
        self._jobs.put((fd, data, offset, buffer))

    def flush(self) -> None:
        self._jobs.join()
        self._raise_if_failed()

    def close(self) -> None:
        if self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join()


class UnitWriter:
    """Generates units on one device and writes their bytes into the (already sized) partial files."""

    def __init__(self, seed: int, distribution: CodeDistribution, device: torch.device):
        self.seed = seed
        self.distribution = distribution
        self.workspace = Workspace(device)
        self._writes = _BackgroundWrites(pinned=device.type == "cuda")
        self._fds: dict[str, int] = {}

    def run(self, task: Task) -> int:
        """Generate `task`'s unit and queue its writes (done at the latest by `flush`); returns its bytes."""
        for name, start, chunk in unit_chunks(task.unit, self.seed, self.distribution, self.workspace):
            path, offset = task.places[name]
            fd = self._fds.get(path)
            if fd is None:
                fd = self._fds[path] = os.open(path, os.O_WRONLY)
            self._writes.write(fd, chunk.contiguous(), offset + start)
        return task.nbytes

    def flush(self) -> None:
        """Wait until every queued write is in its file (raises the first write error)."""
        self._writes.flush()

    def close(self) -> None:
        self._writes.close()
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


_WORKER: UnitWriter | None = None


def _init_worker(seed: int, distribution: CodeDistribution, device: str, threads: int) -> None:
    global _WORKER
    torch.set_num_threads(threads)
    _WORKER = UnitWriter(seed, distribution, torch.device(device))


def _run_batch(tasks: list[Task]) -> int:
    assert _WORKER is not None
    done = sum(_WORKER.run(task) for task in tasks)
    _WORKER.flush()  # a batch counts as done once its bytes are in the files
    return done


def batch_tasks(tasks: list[Task], workers: int, batches_per_worker: int = 8) -> list[list[Task]]:
    """Largest units first (the big BF16 tensors, one random stream each, must not finish last), cut into
    about `workers * batches_per_worker` batches of similar cost; a unit above the target is a batch alone."""
    ordered = sorted(tasks, key=lambda t: t.unit.cost, reverse=True)
    target = sum(t.unit.cost for t in tasks) / max(1, workers * batches_per_worker)
    batches: list[list[Task]] = []
    cost = 0
    for task in ordered:
        if not batches or cost + task.unit.cost > target:
            batches.append([])
            cost = 0
        batches[-1].append(task)
        cost += task.unit.cost
    return batches


def _output_error(e: OSError, what: str) -> OutputError:
    if e.errno == errno.ENOSPC:
        return OutputError(f"{what}: disk full while writing; the partial shards were removed")
    return OutputError(f"{what}: cannot write ({e.strerror or e}); the partial shards were removed")


def write_shards(
    layouts: list[ShardLayout],
    tasks: list[Task],
    *,
    seed: int,
    distribution: CodeDistribution,
    device: torch.device,
    workers: int = 1,
    on_bytes: Callable[[int], None] = lambda n: None,
) -> None:
    """Write every shard of `layouts` by running `tasks` (in this process, or in `workers` spawned ones)."""
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    partials = [partial_path(layout.path) for layout in layouts]
    try:
        for layout, partial in zip(layouts, partials, strict=True):
            with partial.open("wb") as f:
                f.write(layout.header)
                f.truncate(layout.size)
        workers = min(workers, len(tasks))
        if workers <= 1:
            writer = UnitWriter(seed, distribution, device)
            try:
                for task in tasks:
                    on_bytes(writer.run(task))
                writer.flush()
            finally:
                writer.close()
        else:
            _run_in_processes(tasks, seed, distribution, device, workers, on_bytes)
        for partial in partials:
            fd = os.open(partial, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        for layout, partial in zip(layouts, partials, strict=True):
            os.replace(partial, layout.path)
    except BaseException as e:
        for partial in partials:
            partial.unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise _output_error(e, f"folder {layouts[0].path.parent}") from None
        raise


def _run_in_processes(
    tasks: list[Task], seed: int, distribution: CodeDistribution, device: torch.device, workers: int,
    on_bytes: Callable[[int], None],
) -> None:
    # Spawned, not forked: safe with CUDA and with whatever threads the parent runs.
    threads = max(1, (os.cpu_count() or 1) // workers)
    ctx = multiprocessing.get_context("spawn")
    pool = ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_worker,
                               initargs=(seed, distribution, device.type, threads))
    try:
        pending = {pool.submit(_run_batch, batch) for batch in batch_tasks(tasks, workers)}
        while pending:
            done, pending = wait(pending, return_when=FIRST_COMPLETED)
            for future in done:
                on_bytes(future.result())
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
