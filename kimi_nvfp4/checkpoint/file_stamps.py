"""Which file a shard record was written as: device, inode, size and modification time, kept locally.

convert records each shard's stamp right after renaming it into place, in `FOLDER/.kimi_nvfp4_stamps.json`
(hidden: local resume information, never published). On resume, a shard whose file still carries its stamp is the
very file convert wrote and is trusted without reading it; any other file of the right size — replaced by another
process, restored from a copy, edited in place — has its sha256 recomputed and compared with the manifest first
(the way git's index trusts a file whose stat data is unchanged). The stamps are a cache: losing them costs one
read of each finished shard, never a wrong resume.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError

from .writer import write_bytes_atomic

STAMPS_NAME = ".kimi_nvfp4_stamps.json"


class FileStamp(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    device: int
    inode: int
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, path: Path) -> FileStamp | None:
        """The stamp of a regular file (not following a final symlink), or None."""
        try:
            st = os.lstat(path)
        except OSError:
            return None
        if not os.path.isfile(path) or os.path.islink(path):
            return None
        return cls(device=st.st_dev, inode=st.st_ino, size=st.st_size, mtime_ns=st.st_mtime_ns)


def load_stamps(folder: Path) -> dict[str, FileStamp]:
    """The recorded stamps; empty when the file is missing or unreadable (then every shard is re-hashed)."""
    try:
        raw = json.loads((folder / STAMPS_NAME).read_text())
        return {str(k): FileStamp.model_validate(v) for k, v in raw.items()}
    except (OSError, ValueError, AttributeError, ValidationError):
        return {}


def save_stamps(folder: Path, stamps: dict[str, FileStamp], *, durable: bool) -> None:
    data = {k: stamps[k].model_dump() for k in sorted(stamps)}
    write_bytes_atomic(folder / STAMPS_NAME, (json.dumps(data, indent=1) + "\n").encode(), durable=durable)
