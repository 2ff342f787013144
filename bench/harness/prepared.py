"""How an experiment makes its checkpoint folders: each one timed (`prepare_seconds` in the result file, printed as
it is made) and, with `--reuse`, a finished one an earlier run left taken as it is instead of made again."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kimi_nvfp4.calibrate.shard import INPUT_SCALES_SHARD


class PreparedFolders:
    """`prepare(key, fn, work, name, ...)` runs `fn(work, name, ...)`, which makes the folder `work / name`, and
    records its seconds under `key`; when `reuse_when(work / name)` holds, the folder is returned as it is and its
    seconds are recorded as None. A call whose first two arguments are not (work, name) is never reused."""

    def __init__(self, reuse_when: Callable[[Path], bool] | None = None):
        self.reuse_when = reuse_when
        self.seconds: dict[str, float | None] = {}

    def __call__(self, key: str, fn: Callable[..., Path], *args: Any, **kwargs: Any) -> Path:
        if self.reuse_when is not None and len(args) > 1 and isinstance(args[0], Path):
            folder = args[0] / args[1]
            if self.reuse_when(folder):
                self.seconds[key] = None
                return folder
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        self.seconds[key] = time.perf_counter() - t0
        print(json.dumps({"prepared": key, "seconds": round(self.seconds[key], 1)}), flush=True)
        return out


def calibrated_folder(folder: Path) -> bool:
    """A folder calibrate wrote its input scales into."""
    return (folder / INPUT_SCALES_SHARD).is_file()


__all__ = ["PreparedFolders", "calibrated_folder"]
