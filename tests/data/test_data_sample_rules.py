"""`--samples` windows of `--seq-len` tokens, or a named error before any layer (issue #25 §4, data/window_pick.py).

A run asks for samples x seq_len tokens; data that cannot give that many full windows used to be calibrated on
silently (fewer or shorter sequences). Now the stages pick full windows only and stop with a ShortDataError that
names the source, what it gives and the fixes.
"""

from __future__ import annotations

import re

import pytest

from kimi_nvfp4.data.errors import DataError
from kimi_nvfp4.data.window_pick import ShortDataError, pick_full, window_hash
from kimi_nvfp4.stage_kit.samples import DataPart, load_sample_set

from .traffic_fixtures import entry, write_dump


def _dump(folder, tokenizer, lengths: list[int]):
    """One request per length, each its own conversation (distinct first user turn), prompt `length` ids."""
    sp = tokenizer.special_ids
    entries = []
    for i, n in enumerate(lengths):
        head = [sp["<|im_user|>"], *tokenizer.encode(f"task {i}"), sp["<|im_end|>"]]
        body = [1000 + (7 * i + k) % 5000 for k in range(max(0, n - len(head)))]
        entries.append(entry(head + body, None, t=i))
    write_dump(folder / "2026-01-01_00-00-00.pkl", entries)
    return f"sglang-dump:{folder}"


def _load(checkpoint, spec, samples, seq_len, part=DataPart.CALIBRATION):
    return load_sample_set(checkpoint, spec, part=part, samples=samples, seq_len=seq_len, seed=0,
                           heldout_fraction=0.2)


def test_requests_shorter_than_seq_len_are_a_named_error(tmp_path, kimi_tiktoken_dir, kimi_tokenizer):
    spec = _dump(tmp_path / "d", kimi_tokenizer, [20] * 10)
    with pytest.raises(ShortDataError) as e:
        _load(kimi_tiktoken_dir, spec, samples=4, seq_len=64)
    message = str(e.value)
    assert e.value.exit_code == 9 and isinstance(e.value, DataError)
    assert spec in message and "calibration part gives 0 full windows of 64 tokens" in message
    assert "--samples 4" in message and "more data" in message
    shorter = int(re.search(r"--seq-len (\d+) \(about 4 full windows", message).group(1))
    assert shorter < 64
    # the fix it names works: 4 windows of exactly that length
    picked = _load(kimi_tiktoken_dir, spec, samples=4, seq_len=shorter).sequences
    assert [s.numel() for s in picked] == [shorter] * 4


def test_only_full_windows_are_picked_and_the_count_is_named(tmp_path, kimi_tiktoken_dir, kimi_tokenizer):
    spec = _dump(tmp_path / "d", kimi_tokenizer, [40, 40, 40, 12, 12, 12, 12, 12, 12, 12, 12, 40, 40])
    every = _load(kimi_tiktoken_dir, spec, samples=None, seq_len=32)
    full = [s for s in every.sequences if s.numel() == 32]
    assert 0 < len(full) < len(every.sequences)  # short windows exist, and are left out below
    picked = _load(kimi_tiktoken_dir, spec, samples=len(full), seq_len=32)
    assert [s.tolist() for s in picked.sequences] == [s.tolist() for s in full]
    with pytest.raises(ShortDataError, match=rf"gives {len(full)} full windows of 32 tokens .*--samples {len(full)}"):
        _load(kimi_tiktoken_dir, spec, samples=len(full) + 1, seq_len=32)


def test_a_fixed_generated_source_stops_with_the_error_instead_of_looping(kimi_tiktoken_dir):
    with pytest.raises(ShortDataError, match=r"'sample': the heldout part .*--sessions"):
        _load(kimi_tiktoken_dir, "sample", samples=10_000, seq_len=64, part=DataPart.HELDOUT)


def test_pick_full_keeps_the_earlier_pick_when_every_window_is_full():
    import random

    import torch

    windows = [torch.arange(i, i + 8) for i in range(20)]
    order = list(range(20))
    random.Random(3).shuffle(order)
    assert [w.tolist() for w in pick_full(windows, 5, 8, 3)] == [windows[i].tolist() for i in sorted(order[:5])]
    assert window_hash(windows[0]) == window_hash(windows[0].numpy()) == window_hash(list(range(8)))
