"""Which windows a run uses: `--samples` full windows of `--seq-len` tokens, or a named error before any layer.

The rule (docs/data.md "Samples and sequence length"; used by stage_kit/samples.py and `data export`):

- A run asks for `--samples` windows of `--seq-len` tokens, i.e. `samples x seq_len` tokens: calibrate's statistics
  and validate's KL are computed over exactly that many. A window shorter than `seq_len` (a served request shorter
  than the window, or the start of a sequence) is *short*; the picked windows are drawn from the *full* ones only,
  with `--seed`, so the run computes the tokens it was asked to.
- A part with fewer full windows than `--samples` is a `ShortDataError` (a DataError, exit code 9) raised before any
  weights load. It names the source, how many full windows (and shorter ones) the part gives, and the two fixes:
  `--samples F` (what the data holds at this length) or a shorter `--seq-len` (the length at which there are about
  enough). Silently calibrating on fewer or shorter sequences than asked is the failure this replaces.
- Generated sources (`builtin`, `tree:`) generate more sessions until the part has enough (stage_kit/samples.py);
  fixed sources (files, dumps, `sample`) cannot, and get the error.

Held-out disjointness across runs: calibrate records a short hash of every window it used
(`calibration_window_hashes`, manifest `stages.calibrate.outputs.calibration_windows`: hashes only, never ids), and
the held-out part loaded for that checkpoint drops any window with one of those hashes. The split by conversation
and the shared prefix tree make held-out windows disjoint from the calibration windows *of the same load*; the
recorded hashes extend that to the windows calibrate actually used, whatever its `--seed` or session count (a
`builtin` run calibrated with seed 1 and validated with seed 0 renders different sessions, whose windows can
still coincide: two sessions reading the same file region give the same window).
"""

from __future__ import annotations

import hashlib
import random
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from .errors import DataError

# manifest: stages["calibrate"].outputs[CALIBRATION_WINDOWS_RECORD] = [hex hash of each window calibrate used]
CALIBRATE_STAGE_NAME = "calibrate"
CALIBRATION_WINDOWS_RECORD = "calibration_windows"
# 64 bits: a false match among 512 calibration x 10^6 held-out windows has probability ~3e-11.
WINDOW_HASH_BYTES = 8


class ShortDataError(DataError):
    """The data gives fewer full `--seq-len` windows than `--samples` asks for."""


def window_hash(window: torch.Tensor | np.ndarray | Sequence[int]) -> str:
    """Hex blake2b of a window's int64 ids: the same value for the same ids however they are held."""
    if isinstance(window, torch.Tensor):
        window = window.detach().cpu().numpy()
    data = np.ascontiguousarray(np.asarray(window, dtype=np.int64)).tobytes()
    return hashlib.blake2b(data, digest_size=WINDOW_HASH_BYTES).hexdigest()


def calibration_window_hashes(sequences: Sequence[torch.Tensor]) -> list[str]:
    """What calibrate records of the windows it used (sorted: the record says nothing about their order)."""
    return sorted({window_hash(s) for s in sequences})


def recorded_calibration_hashes(checkpoint: str | Path) -> frozenset[str]:
    """The window hashes the checkpoint's calibrate stage recorded (empty when it has none: not calibrated yet, a
    folder without a manifest, or calibrated before hashes were recorded)."""
    from ..checkpoint.manifest import MANIFEST_NAME, load_manifest
    from ..errors import CheckpointError

    if not (Path(checkpoint) / MANIFEST_NAME).is_file():
        return frozenset()
    try:
        record = load_manifest(checkpoint).stages.get(CALIBRATE_STAGE_NAME)
    except CheckpointError:
        return frozenset()  # the stage that reads the manifest for its own use reports it
    hashes = record.outputs.get(CALIBRATION_WINDOWS_RECORD) if record is not None else None
    return frozenset(h for h in hashes if isinstance(h, str)) if isinstance(hashes, list) else frozenset()


def full_windows(sequences: Sequence[torch.Tensor], seq_len: int) -> list[torch.Tensor]:
    return [s for s in sequences if int(s.numel()) == seq_len]


def pick_full(sequences: Sequence[torch.Tensor], samples: int, seq_len: int, seed: int) -> list[torch.Tensor]:
    """`samples` of the full windows, chosen with `seed`, in their original order (all of them when fewer).

    The order is a seeded shuffle of the full windows' positions: when every window is full (the common case
    for agent traffic, whose prompts are longer than a window) the pick is the one earlier versions made."""
    full = full_windows(sequences, seq_len)
    order = list(range(len(full)))
    random.Random(seed).shuffle(order)
    return [full[i] for i in sorted(order[:samples])]


def suggested_seq_len(sequences: Sequence[torch.Tensor], samples: int) -> int | None:
    """The `samples`-th longest window: at that `--seq-len` about `samples` windows are full (each of these
    windows ends a served sequence at least that long). None when there are fewer windows than samples."""
    lengths = sorted((int(s.numel()) for s in sequences), reverse=True)
    return lengths[samples - 1] if len(lengths) >= samples and lengths[samples - 1] >= 2 else None


def check_enough(sequences: Sequence[torch.Tensor], *, samples: int, seq_len: int, data: str, part: str,
                 generated: bool) -> None:
    """ShortDataError when fewer than `samples` of `sequences` are full `seq_len` windows (see the module doc)."""
    full = len(full_windows(sequences, seq_len))
    require_full(full, len(sequences) - full, samples=samples, seq_len=seq_len, data=data, part=part,
                 generated=generated, shorter=suggested_seq_len(sequences, samples))


def require_full(full: int, short: int, *, samples: int, seq_len: int, data: str, part: str, generated: bool,
                 shorter: int | None = None) -> None:
    """ShortDataError when `full` < `samples`, from counts (the streaming path keeps no window it does not pick)."""
    if full >= samples:
        return
    fixes = [f"--samples {full}" if full else None]
    if shorter is not None and shorter < seq_len:
        fixes.append(f"--seq-len {shorter} (about {samples} full windows at that length)")
    elif short:
        fixes.append("a shorter --seq-len")
    fixes.append("more sessions (--sessions, for builtin and tree:)" if generated else "more data")
    raise ShortDataError(
        f"--data {data!r}: the {part} part gives {full} full windows of {seq_len} tokens "
        f"(and {short} shorter, left out: a window must hold the --seq-len tokens asked for), fewer than "
        f"--samples {samples}; use {', or '.join(f for f in fixes if f)}")


def drop_recorded(sequences: Sequence[torch.Tensor], recorded: frozenset[str]) -> tuple[list[torch.Tensor], int]:
    """(the windows whose hash calibrate did not record, how many were dropped)."""
    if not recorded:
        return list(sequences), 0
    kept = [s for s in sequences if window_hash(s) not in recorded]
    return kept, len(sequences) - len(kept)
