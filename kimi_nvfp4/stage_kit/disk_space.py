"""Disk is part of the plan: what a stage will write, checked against the free space before it writes anything.

convert writes an output about the size of the source (NVFP4 and INT4 are both ~4.5 bits per expert weight; every
other tensor is copied): 594 GB for Kimi K2.6. A conversion that runs out of disk after hours loses them (the shard
in progress), so the free space is checked at the start for what is still to write. calibrate's and validate's
resume snapshots hold every hidden-state stream (14 GiB each at K2.6's 512 x 2048 defaults; validate has five): they
are optional -- a snapshot that cannot be written is dropped with a warning (stage_kit/resume.py) -- so their need
is recorded in the memory plan and warned about, not refused.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from ..errors import ResourceError

GIB = 2**30
# Kept free besides what the stage writes: index, manifest, reports and the filesystem's own reserve.
DISK_MARGIN_BYTES = 1 * GIB


def free_bytes(path: str | Path) -> int:
    """Free bytes on the filesystem that holds `path` (or would: its nearest existing ancestor)."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return shutil.disk_usage(p).free


def require_free_space(path: str | Path, need: int, what: str) -> int:
    """Raise ResourceError (nothing written) when `path`'s filesystem has less than `need` + DISK_MARGIN_BYTES
    free; returns the free bytes."""
    free = free_bytes(path)
    if need + DISK_MARGIN_BYTES > free:
        raise ResourceError(
            f"{what} needs ~{need / GIB:.1f} GiB more on the disk of {path}, which has {free / GIB:.1f} GiB free "
            f"(plus a {DISK_MARGIN_BYTES / GIB:.0f} GiB margin); free space there or write elsewhere")
    return free


def warn_if_snapshots_cannot_fit(snapshot_bytes: int, folder: str | Path, resume_every: int, stage: str) -> None:
    """A one-line warning when a resume snapshot (two while the older is replaced) does not fit the free space of
    the folder snapshots go to: the run goes on without them (stage_kit/resume.py), but a kill then costs it all."""
    if resume_every <= 0 or snapshot_bytes <= 0:
        return
    free = free_bytes(folder)
    if 2 * snapshot_bytes + DISK_MARGIN_BYTES > free:
        import logging

        logging.getLogger(__name__).warning(
            "%s: a resume snapshot needs ~%.1f GiB (two while one replaces the other) and %s has %.1f GiB free: "
            "snapshots will be skipped and a killed run starts again from layer 0 (--resume-every 0 turns them off)",
            stage, snapshot_bytes / GIB, folder, free / GIB)
