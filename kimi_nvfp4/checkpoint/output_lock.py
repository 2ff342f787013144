"""One writer per checkpoint folder: an OS file lock held by every command that writes into it.

convert, calibrate, validate (when it records into the checkpoint), publish and run take an exclusive `flock` on
`FOLDER/.kimi_nvfp4.lock` for as long as they work on the folder. Two converts racing into one folder (one of them
with `--overwrite` and another method) once left a manifest that described one run over shards of the other; with
the lock the second process stops at once with an OutputError naming the holder (pid, command, start time and host,
which the holder writes into the lock file).

- The OS releases the lock when the holder exits, however it exits (kill -9 included), so a stale lock file never
  blocks anyone; the file itself stays (hidden: never published, never "foreign content", never cleared by
  `--overwrite`): deleting it after use would let a process that opened the old file and one that creates a new one
  both "hold" the lock. Only a run that fails removes a lock file (and an empty folder) it created itself, while
  still holding it, so that refusing a foreign folder leaves nothing behind.
- Re-entrant within a process: `run` holds the lock and calls convert, calibrate, validate and publish, which take
  it again (a depth count; `flock` on a second descriptor of the same file would conflict with ourselves).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import inspect
import json
import os
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TypeVar

from ..errors import OutputError
from .nesting import refuse_nested

LOCK_NAME = ".kimi_nvfp4.lock"
_HOLDER_MAX_BYTES = 4096


@dataclass
class _Held:
    fd: int
    depth: int
    created_file: bool  # this acquisition made the lock file (and `created_folder` the folder)
    created_folder: bool


_held: dict[str, _Held] = {}  # real path of the folder -> our lock on it
_registry = threading.Lock()


def _holder_text(fd: int) -> str:
    try:
        raw = os.pread(fd, _HOLDER_MAX_BYTES, 0)
        info = json.loads(raw) if raw.strip() else {}
    except (OSError, ValueError):
        info = {}
    if not isinstance(info, dict) or "pid" not in info:
        return "another process (it has not written its name yet)"
    return (f"pid {info.get('pid')} (kimi-nvfp4 {info.get('command', '?')}, started {info.get('started', '?')} "
            f"on {info.get('host', '?')})")


def _acquire(folder: Path, command: str, create: bool) -> str | None:
    """Take (or re-enter) the lock; returns the registry key, or None when there is no folder to lock."""
    created_folder = False
    if create:
        try:
            created_folder = not folder.exists()
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise OutputError(f"file {folder}: cannot create the output folder ({e.strerror or e})") from None
    elif not folder.is_dir():
        return None  # nothing to protect: the stage itself reports the missing folder
    key = os.path.realpath(folder)
    with _registry:
        held = _held.get(key)
        if held is not None:
            held.depth += 1
            return key
        path = Path(key) / LOCK_NAME
        try:
            created_file = not os.path.lexists(path)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise OutputError(f"file {path}: cannot open the folder's lock file ({e.strerror or e})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder_text(fd)
            os.close(fd)
            raise OutputError(
                f"file {folder}: the folder is in use by {holder}; wait for it to finish (or stop it) and run "
                f"`kimi-nvfp4 {command}` again"
            ) from None
        except OSError as e:
            os.close(fd)
            raise OutputError(f"file {path}: cannot lock the folder ({e.strerror or e})") from None
        info = {"pid": os.getpid(), "command": command, "host": socket.gethostname(),
                "started": datetime.now(timezone.utc).isoformat(timespec="seconds")}
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
        except OSError:
            pass  # the lock holds without the note (a full disk): others then see "another process"
        _held[key] = _Held(fd, 1, created_file, created_folder)
        return key


def _release(key: str, failed: bool) -> None:
    """Drop one level; at the last, release the flock. A run that failed leaves the folder as it found it: a lock
    file (and an empty folder) it created is removed, so refusing a foreign folder writes nothing into it."""
    with _registry:
        held = _held[key]
        held.depth -= 1
        if held.depth:
            return
        del _held[key]
        if failed and held.created_file:
            with contextlib.suppress(OSError):
                os.unlink(Path(key) / LOCK_NAME)  # still locked: nobody can have locked this file in between
        os.close(held.fd)  # releases the flock
        if failed and held.created_folder:
            with contextlib.suppress(OSError):
                os.rmdir(key)  # only if empty


@contextlib.contextmanager
def output_lock(folder: str | Path, command: str, *, create: bool = True) -> Iterator[None]:
    """Hold the folder's lock for the block. `create`: make the folder if missing (convert, run); otherwise a missing
    folder is not locked (calibrate, validate, publish report it themselves). Raises OutputError when another
    process holds it."""
    key = _acquire(Path(folder), command, create)
    failed = True
    try:
        yield
        failed = False
    finally:
        if key is not None:
            _release(key, failed)


def holds_lock(folder: str | Path) -> bool:
    """Whether this process holds the lock on `folder` now."""
    with _registry:
        return os.path.realpath(folder) in _held


F = TypeVar("F", bound=Callable[..., Any])


def _torchrun_rank() -> int | None:
    """This process's rank under torchrun (its RANK variable), None outside one."""
    value = os.environ.get("RANK")
    return int(value) if value is not None and value.isdigit() and os.environ.get("WORLD_SIZE", "1") != "1" else None


def holds_output_lock(
    command: str,
    folder_arg: str,
    *,
    create: bool = False,
    when: Callable[[dict[str, Any]], bool] | None = None,
    source_arg: str | None = None,
) -> Callable[[F], F]:
    """Decorator: the stage function holds `output_lock(<its folder_arg argument>, command)` while it runs;
    `when(arguments)` (all arguments by name, defaults applied) decides whether this call writes into the folder.
    `source_arg`: an argument naming the source; when it is a local folder, an output nested with it is refused
    (`checkpoint/nesting.py`) before the folder or its lock file is created."""

    def wrap(fn: F) -> F:
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def locked(*args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            if when is not None and not when(bound.arguments):
                return fn(*args, **kwargs)
            if _torchrun_rank() not in (None, 0):
                # a data-parallel job (kimi_nvfp4.distributed): rank 0 alone writes, so it alone holds the lock
                return fn(*args, **kwargs)
            source = bound.arguments.get(source_arg) if source_arg else None
            if source is not None and Path(source).is_dir():
                refuse_nested(source, bound.arguments[folder_arg])
            with output_lock(bound.arguments[folder_arg], command, create=create):
                return fn(*args, **kwargs)

        return locked  # type: ignore[return-value]

    return wrap
