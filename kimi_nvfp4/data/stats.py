"""What `kimi-nvfp4 data stats` reports and `data export` writes.

The stats report is counts only (records, skip reasons by kind, requests, conversations, tokens, the unique-token
fraction): it may be shared and published; it never holds text or token ids of the data. The export is the
opposite, the windows themselves, for the user's own eyes: written under a temporary name, then renamed.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Sequence

import torch

from .source_registry import LoadResult
from .windows import SplitWindows


def data_stats_report(results: Sequence[LoadResult], windows: SplitWindows, *, seq_len: int,
                      preserve_thinking: bool) -> dict[str, Any]:
    sources = []
    for r in results:
        sources.append({"source": r.source, "tokens": r.provenance, "files": r.files, "records_read": r.read,
                        "conversations": len(r.conversations), "requests": len(r.requests),
                        "skipped": r.skipped, "skipped_by_reason": dict(r.skip_counts),
                        # file and record of the first few, never their content
                        "first_skipped": r.errors[:5]})
    return {
        "sources": sources,
        "seq_len": seq_len,
        "preserve_thinking": preserve_thinking,
        "conversations": {"calibration": windows.calibration_groups, "heldout": windows.heldout_groups},
        "unique_token_fraction": round(windows.unique_token_fraction, 6),
        "calibration": windows.calibration.stats.to_dict(),
        "heldout": windows.heldout.stats.to_dict(),
    }


def pick(sequences: Sequence[torch.Tensor], samples: int | None, seed: int, *, seq_len: int, data: str,
         part: str) -> list[torch.Tensor]:
    """`samples` full windows chosen as stage_kit/samples.py chooses them, or the ShortDataError it raises
    (data/window_pick.py); every window of 2+ tokens, in order, when `samples` is None."""
    from .window_pick import check_enough, pick_full

    usable = [s for s in sequences if s.numel() >= 2]
    if samples is None:
        return usable
    check_enough(usable, samples=samples, seq_len=seq_len, data=data, part=part, generated=False)
    return pick_full(usable, samples, seq_len, seed)


def _atomic_write(path: Path, write) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial")
    with partial.open("w", encoding="utf-8") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, path)


def write_json(path: Path, report: dict) -> None:
    _atomic_write(path, lambda f: f.write(json.dumps(report, indent=2) + "\n"))


def write_windows(path: Path, parts: dict[str, list[torch.Tensor]]) -> None:
    def write(f):
        for split, sequences in parts.items():
            for s in sequences:
                f.write(json.dumps({"split": split, "ids": s.tolist()}) + "\n")
    _atomic_write(path, write)
