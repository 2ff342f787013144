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
from ..data.source_registry import DEFAULT_MAX_BAD_FRACTION

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
    skip_reasons: list[str] = field(default_factory=list)  # file and record of each, never content
    unique_token_fraction: float | None = None  # new tokens / tokens of every request (data/windows.py)

    @property
    def tokens(self) -> int:
        return sum(int(s.numel()) for s in self.sequences)


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
    max_bad_fraction: float = DEFAULT_MAX_BAD_FRACTION,
) -> SampleSet:
    """Load, split, render and pick `samples` sequences of `part` (raises DataError if none).

    Every check on the data runs here, before the calling stage loads any weights: a source with more than
    `max_bad_fraction` unreadable records, a part with no conversation, and token ids outside the checkpoint's
    vocabulary (config.json `vocab_size`) are DataErrors naming the source, record or window.

    Generated sources (`builtin`, `tree:`) make `generated_sessions` sessions; by default enough for
    `samples` one-window sessions in this part (generation runs real tools: ~0.3 s per session).
    """
    from ..data.loaders import load_data_spec
    from ..data.source_registry import check_bad_fraction
    from ..data.tokenizer import load_tokenizer
    from ..data.windows import check_vocabulary, checkpoint_vocab_size, split_windows

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
    check_bad_fraction(results, max_bad_fraction)
    skipped = sum(r.skipped for r in results)
    reasons = [e for r in results for e in r.errors][:20]
    tokenizer = load_tokenizer(checkpoint)
    windows = split_windows(results, tokenizer, seq_len, heldout_fraction=heldout_fraction,
                            split_seed=HELDOUT_SPLIT_SEED, need_heldout=part is DataPart.HELDOUT)
    chosen = windows.calibration if part is DataPart.CALIBRATION else windows.heldout
    groups = windows.calibration_groups if part is DataPart.CALIBRATION else windows.heldout_groups
    if not groups:
        total = windows.calibration_groups + windows.heldout_groups
        raise DataError(
            f"--data {data!r}: no conversations left for the {part.value} part "
            f"({total} usable, held-out fraction {heldout_fraction}); give more sessions"
        )
    sequences = [s.to(torch.long) for s in chosen.sequences if s.numel() >= 2]
    if not sequences:
        raise DataError(f"--data {data!r}: the {part.value} sessions rendered to no sequence of 2+ tokens")
    vocab_size = checkpoint_vocab_size(checkpoint)
    if vocab_size is not None:
        check_vocabulary(sequences, vocab_size, data=data, where=part.value)
    order = list(range(len(sequences)))
    random.Random(seed).shuffle(order)
    picked = [sequences[i] for i in sorted(order[:samples])]
    return SampleSet(picked, part, groups, skipped, reasons, unique_token_fraction=windows.unique_token_fraction)
