"""Write files under a temporary name and rename them when complete (design.md, common rules)."""

from __future__ import annotations

import os
from pathlib import Path


def partial_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.partial")


def write_bytes_atomic(path: Path, data: bytes) -> Path:
    path = Path(path)
    tmp = partial_path(path)
    with tmp.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def write_text_atomic(path: Path, text: str) -> Path:
    return write_bytes_atomic(path, text.encode("utf-8"))
