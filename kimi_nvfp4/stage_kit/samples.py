"""Token sequences for calibrate (the calibration part) and validate (the held-out part).

Both stages load the same `--data` spec, split it with `split_heldout` under a FIXED split seed
(the split is by conversation id, so it does not depend on `--seed` or on how many sessions a
generator produced), render each session's served requests with the checkpoint's own chat template
and tokenizer (`kimi_nvfp4.data`, which never executes checkpoint code) into distinct windows of
at most `seq_len` tokens, then pick `samples` full `seq_len` windows with `--seed` (data/window_pick.py: fewer
than asked is a named DataError before any layer). Calibration never sees a held-out session, no held-out window
equals a calibration window of the same load, and none equals a window the checkpoint's calibrate run recorded.
"""

from __future__ import annotations

import math
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
# An SGLang dump folder at least this large is windowed streaming, in bounded memory (data/stream_windows.py);
# smaller ones, and every other source, through the exact in-memory prefix tree (data/windows.py).
STREAM_MIN_BYTES = 256 * 2**20
# Rounds of doubling the generated sessions while a part has fewer full windows than asked (x2**5 = 32x at most).
MAX_GENERATION_ROUNDS = 6


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
    excluded_windows: int = 0  # held-out windows left out because calibrate used them (data/window_pick.py)

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
    samples: int | None,
    seq_len: int,
    seed: int,
    heldout_fraction: float = HELDOUT_FRACTION,
    generated_sessions: int | None = None,
    max_bad_fraction: float = DEFAULT_MAX_BAD_FRACTION,
) -> SampleSet:
    """Load, split, render and pick `samples` full windows of `seq_len` tokens of `part` (data/window_pick.py).

    Every check on the data runs here, before the calling stage loads any weights: a source with more than
    `max_bad_fraction` unreadable records, a part with no conversation, token ids outside the checkpoint's
    vocabulary (config.json `vocab_size`), and fewer than `samples` full windows (`ShortDataError`) are DataErrors
    naming the source, record or window. The held-out part also leaves out every window the checkpoint's calibrate
    stage recorded as used (data/window_pick.recorded_calibration_hashes).

    Generated sources (`builtin`, `tree:`) make `generated_sessions` sessions; by default enough for `samples`
    one-window sessions in this part, doubled (up to `MAX_GENERATION_ROUNDS` times) while the part has fewer full
    windows than asked (generation runs real tools: ~0.3 s per session). `samples=None` takes every window, short
    ones included (tests and tools that want the whole part).
    """
    from ..data.windows import check_vocabulary, checkpoint_vocab_size
    from ..data.window_pick import check_enough, drop_recorded, pick_full, recorded_calibration_hashes

    part = DataPart(part)
    if samples is not None and samples < 1:
        raise DataError(f"--samples must be at least 1, got {samples}")
    if seq_len < 2:
        raise DataError(f"--seq-len must be at least 2, got {seq_len}")
    if not 0.0 < heldout_fraction < 1.0:
        raise DataError(f"held-out fraction must lie in (0, 1), got {heldout_fraction}")
    part_fraction = heldout_fraction if part is DataPart.HELDOUT else 1.0 - heldout_fraction
    n_sessions = generated_sessions or math.ceil((samples or 1) * _GENERATED_SESSIONS_PER_SAMPLE / part_fraction)
    recorded = recorded_calibration_hashes(checkpoint) if part is DataPart.HELDOUT else frozenset()
    vocab_size = checkpoint_vocab_size(checkpoint)
    if samples is not None and streams(data):
        return _streamed_sample_set(checkpoint, data, part, samples, seq_len, seed, heldout_fraction, recorded,
                                    vocab_size, max_bad_fraction)
    grown_from = None
    for _ in range(MAX_GENERATION_ROUNDS):
        loaded = _load_part(checkpoint, data, part, seq_len, heldout_fraction, n_sessions, seed, max_bad_fraction)
        if vocab_size is not None:
            check_vocabulary(loaded.sequences, vocab_size, data=data, where=part.value)
        sequences, excluded = drop_recorded(loaded.sequences, recorded)
        if samples is None:
            break
        enough = sum(1 for s in sequences if s.numel() == seq_len) >= samples
        # only generated sources make more when asked to, and only when the user left the count to us
        if enough or not loaded.generated or generated_sessions is not None or loaded.groups == grown_from:
            break
        grown_from, n_sessions = loaded.groups, n_sessions * 2
    if samples is None:
        picked = sequences
    else:
        check_enough(sequences, samples=samples, seq_len=seq_len, data=data, part=part.value,
                     generated=loaded.generated)
        picked = pick_full(sequences, samples, seq_len, seed)
    return SampleSet(picked, part, loaded.groups, loaded.skipped, loaded.reasons,
                     unique_token_fraction=loaded.unique_token_fraction, excluded_windows=excluded)


@dataclass
class _LoadedPart:
    sequences: list[torch.Tensor]
    groups: int
    skipped: int
    reasons: list[str]
    unique_token_fraction: float
    generated: bool  # some source generates sessions (more sessions, more windows)


def _load_part(checkpoint, data: str, part: DataPart, seq_len: int, heldout_fraction: float, n_sessions: int,
               seed: int, max_bad_fraction: float) -> _LoadedPart:
    """Every window (2+ tokens) of `part`, with what was read; DataError when the part has no conversation."""
    from ..data.loaders import load_data_spec
    from ..data.source_registry import Provenance, check_bad_fraction
    from ..data.tokenizer import load_tokenizer
    from ..data.windows import split_windows

    results = load_data_spec(data, n_sessions=n_sessions, seed=seed)
    check_bad_fraction(results, max_bad_fraction)
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
        raise DataError(f"--data {data!r}: the {part.value} sessions rendered to no sequence of 2+ tokens"
                        + why_no_sequence(chosen.stats.rendered_tokens, part))
    return _LoadedPart(sequences, groups, sum(r.skipped for r in results), [e for r in results for e in r.errors][:20],
                       windows.unique_token_fraction, any(r.provenance == Provenance.GENERATED for r in results))


def why_no_sequence(rendered_tokens: int, part: DataPart) -> str:
    """Why a part rendered to no window: a held-out part whose tokens all fell in windows the calibration part
    also has (dropped, so that shared text is never on both sides), or sessions too short for any window."""
    if part is DataPart.HELDOUT and rendered_tokens >= 2:
        return (": all of their windows duplicate calibration windows (the held-out part drops every window the "
                "calibration part also has, so shared text is never on both sides); give sessions that differ from "
                "the calibration ones, more sessions, or another --seq-len")
    return ": the sessions are too short to make a window of 2+ tokens"


def streams(data: str) -> bool:
    """Whether `data` is windowed streaming: one `sglang-dump:` folder of at least STREAM_MIN_BYTES of pickles."""
    from ..data.source_registry import parse_part

    if "," in data:
        return False
    source, body, _ = parse_part(data.strip())
    if source.name != "sglang-dump" or not Path(body).is_dir():
        return False
    return sum(f.stat().st_size for f in Path(body).rglob("*.pkl") if f.is_file()) >= STREAM_MIN_BYTES


def _streamed_sample_set(checkpoint, data: str, part: DataPart, samples: int, seq_len: int, seed: int,
                         heldout_fraction: float, recorded: frozenset[str], vocab_size: int | None,
                         max_bad_fraction: float) -> SampleSet:
    """load_sample_set's checks and pick over data/stream_windows.py (bottom-k picks by hash, counts only)."""
    from ..data.source_registry import LoadResult
    from ..data.stream_windows import StreamWindower, stream_dump_requests, stream_sample_windows
    from ..data.tokenizer import load_tokenizer
    from ..data.window_pick import require_full

    result = LoadResult(source=data.strip())
    windower = StreamWindower(load_tokenizer(checkpoint), seq_len, samples, seed, heldout_fraction=heldout_fraction,
                              split_seed=HELDOUT_SPLIT_SEED, vocab_size=vocab_size, exclude=recorded)
    streamed = stream_sample_windows(stream_dump_requests(data.strip(), result), windower)
    read = streamed.calibration.requests + streamed.heldout.requests + result.skipped
    if not read or result.skipped / read > max_bad_fraction:
        reasons = ", ".join(f"{n} {k}" for k, n in result.skip_counts.most_common())
        first = f"; first: {result.errors[0]}" if result.errors else ""
        raise DataError(f"{data}: {result.skipped} of {read} records are unreadable (more than the "
                        f"{max_bad_fraction:.0%} allowed: {reasons}){first}; fix or remove them")
    chosen = streamed.calibration if part is DataPart.CALIBRATION else streamed.heldout
    if not chosen.conversations:
        raise DataError(f"--data {data!r}: no conversations left for the {part.value} part "
                        f"(held-out fraction {heldout_fraction}); give more sessions")
    require_full(chosen.full, chosen.short, samples=samples, seq_len=seq_len, data=data, part=part.value,
                 generated=False)
    sequences = streamed.sequences(part.value, samples)
    require_full(len(sequences), chosen.short, samples=samples, seq_len=seq_len, data=data, part=part.value,
                 generated=False)  # held-out picks equal to calibration picks are dropped
    return SampleSet(sequences, part, len(chosen.conversations), result.skipped, result.errors[:20],
                     unique_token_fraction=streamed.unique_token_fraction, excluded_windows=streamed.excluded)
