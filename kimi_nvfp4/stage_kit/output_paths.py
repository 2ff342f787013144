"""Fail before the work, not after it: every output location a stage will write is checked writable first.

A report folder created at the end of an hours-long validate, or a publish `--json` path tried after the upload,
used to fail only when everything else was done. `require_writable_dir` / `require_writable_file` are called at
the start of each stage with every location it will write: a location that does not exist yet counts as
writable when its nearest existing ancestor is a writable folder (the stage creates the rest), and the check
writes and removes a probe file there, because permission bits say nothing about read-only mounts.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from ..errors import OutputError


def _nearest_existing(path: Path) -> Path:
    for candidate in (path, *path.parents):
        if candidate.exists() or candidate.is_symlink():
            return candidate
    return Path(path.anchor or ".")


def _probe(folder: Path, what: str, target: Path) -> None:
    try:
        fd, name = tempfile.mkstemp(prefix=".kimi-nvfp4-write-probe-", dir=folder)
    except OSError as e:
        raise OutputError(f"{what} {target} cannot be written: {folder} is not writable ({e.strerror or e})") from None
    os.close(fd)
    os.unlink(name)


def require_writable_dir(path: str | Path, *, what: str = "output folder") -> Path:
    """`path` is (or can be created as) a folder this process can write; returns it. Nothing is created.

    :raises OutputError: it is a file, or it or its nearest existing ancestor is not a writable folder
    """
    path = Path(path).expanduser()
    existing = _nearest_existing(path.absolute())
    if not existing.is_dir():
        raise OutputError(f"{what} {path} cannot be created: {existing} is not a folder")
    _probe(existing, what, path)
    return path


def require_writable_file(path: str | Path, *, what: str = "output file") -> Path:
    """`path` can be written (created or replaced) as a file by a write-then-rename in its folder; returns it.

    :raises OutputError: it is a folder, or its folder cannot be created or written
    """
    path = Path(path).expanduser()
    if path.is_dir():
        raise OutputError(f"{what} {path} is a folder, expected a file path")
    require_writable_dir(path.absolute().parent, what=f"the folder of {what}")
    return path
