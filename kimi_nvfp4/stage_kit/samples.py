"""Token sequences for calibrate (the calibration part) and validate (the held-out part).

Both stages load the same `--data` spec, split it with `split_heldout` under a FIXED split seed
(the split is by conversation id, so it does not depend on `--seed` or on how many sessions a
generator produced), render each session's served requests with the checkpoint's own chat template
and tokenizer (`kimi_nvfp4.data`, which never executes checkpoint code) into distinct windows of
at most `seq_len` tokens, then pick `samples` sequences with `--seed`. Calibration never sees a
held-out session, and no held-out window equals a calibration window.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

import torch

from ..data.errors import DataError
from ..data.render import DEFAULT_HELDOUT_FRACTION

# Fraction of conversations reserved for validate; fixed so calibrate and validate agree.
HELDOUT_FRACTION = DEFAULT_HELDOUT_FRACTION
# The held-out split must not move when a user changes --seed.
HELDOUT_SPLIT_SEED = 0
# Generated sources (`builtin`, `tree:`) make this many sessions per requested sample at least,
# so both parts of the split have enough after the held-out cut.
_GENERATED_SESSIONS_PER_SAMPLE = 1


class DataPart(str, Enum):
    CALIBRATION = "calibration"
    HELDOUT = "heldout"


@dataclass
class SampleSet:
    """The rendered sequences of one part, and what was read to get them."""

    sequences: list[torch.Tensor]  # int64 [<= seq_len] each
    part: DataPart
    conversations: int  # conversations in this part of the split
    skipped: int  # records the loaders could not use
    skip_reasons: list[str] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return sum(int(s.numel()) for s in self.sequences)


def _why_no_sequence(chosen, tokenizer, seq_len: int, exclude) -> str:
    """The reason behind an empty rendering, for the error: every window duplicated a calibration window, or the
    sessions are too short to make a window at all."""
    if exclude:
        from ..data.render import render_sessions  # as load_sample_set: the data package loads on first use

        without = [s for s in render_sessions(chosen, tokenizer, seq_len) if s.numel() >= 2]
        if without:
            return (f": all {len(without)} of their windows duplicate calibration windows (the held-out part drops "
                    "every window the calibration part also has, so shared text is never on both sides); give "
                    "sessions that differ from the calibration ones, more sessions, or another --seq-len")
    return f": the {len(chosen)} sessions are too short to make a window of 2+ tokens"


def load_sample_set(
    checkpoint: str | Path,
    data: str,
    *,
    part: DataPart | str,
    samples: int,
    seq_len: int,
    seed: int,
    heldout_fraction: float = HELDOUT_FRACTION,
    generated_sessions: int | None = None,
) -> SampleSet:
    """Load, split, render and pick `samples` sequences of `part` (raises DataError if none).

    Generated sources (`builtin`, `tree:`) make `generated_sessions` sessions; by default enough for
    `samples` one-window sessions in this part (generation runs real tools: ~0.3 s per session).
    """
    from ..data.loaders import load_data_spec
    from ..data.render import render_sessions, split_heldout
    from ..data.tokenizer import load_tokenizer

    part = DataPart(part)
    if samples < 1:
        raise DataError(f"--samples must be at least 1, got {samples}")
    if seq_len < 2:
        raise DataError(f"--seq-len must be at least 2, got {seq_len}")
    if not 0.0 < heldout_fraction < 1.0:
        raise DataError(f"held-out fraction must lie in (0, 1), got {heldout_fraction}")
    part_fraction = heldout_fraction if part is DataPart.HELDOUT else 1.0 - heldout_fraction
    n_sessions = generated_sessions or math.ceil(samples * _GENERATED_SESSIONS_PER_SAMPLE / part_fraction)
    results = load_data_spec(data, n_sessions=n_sessions, seed=seed)
    seen: set[str] = set()
    conversations = []
    for r in results:
        for c in r.conversations:
            if c.id not in seen:
                seen.add(c.id)
                conversations.append(c)
    skipped = sum(r.skipped for r in results)
    reasons = [e for r in results for e in r.errors][:20]
    calibration, heldout = split_heldout(conversations, heldout_fraction, HELDOUT_SPLIT_SEED)
    chosen = calibration if part is DataPart.CALIBRATION else heldout
    if not chosen:
        raise DataError(
            f"--data {data!r}: no conversations left for the {part.value} part "
            f"({len(conversations)} usable, held-out fraction {heldout_fraction}); give more sessions"
        )
    tokenizer = load_tokenizer(checkpoint)
    # the held-out part reserves the calibration part's windows: shared text (system prompt, tool
    # declarations) never turns up on both sides (data/render.py)
    exclude = calibration if part is DataPart.HELDOUT else ()
    sequences = [s.to(torch.long) for s in render_sessions(chosen, tokenizer, seq_len, exclude=exclude)
                 if s.numel() >= 2]
    if not sequences:
        raise DataError(f"--data {data!r}: the {part.value} sessions rendered to no sequence of 2+ tokens"
                        + _why_no_sequence(chosen, tokenizer, seq_len, exclude))
    order = list(range(len(sequences)))
    random.Random(seed).shuffle(order)
    picked = [sequences[i] for i in sorted(order[:samples])]
    return SampleSet(picked, part, len(chosen), skipped, reasons)
