"""Large dump folders are windowed streaming, in bounded memory (data/stream_windows.py, issue #27 "Streaming")."""

from __future__ import annotations

import random

import numpy as np
import pytest

from kimi_nvfp4.data.errors import DataError
from kimi_nvfp4.data.render import split_heldout
from kimi_nvfp4.data.stream_windows import StreamWindower, stream_sample_windows
from kimi_nvfp4.data.traffic import TrafficRequest
from kimi_nvfp4.stage_kit import samples as samples_module
from kimi_nvfp4.stage_kit.samples import DataPart, load_sample_set

from .traffic_fixtures import entry, write_dump

SEQ_LEN = 32


def _sessions(tokenizer, n: int, turns: int = 4) -> list[list[tuple[list[int], list[int]]]]:
    """n agent sessions: each turn's prompt is the previous turn's prompt + output + a new tool result."""
    sp = tokenizer.special_ids
    rng = random.Random(5)
    out = []
    for s in range(n):
        prompt = [sp["<|im_system|>"], *range(100, 140), sp["<|im_end|>"],  # a shared 42-token preamble
                  sp["<|im_user|>"], *tokenizer.encode(f"session {s}"), sp["<|im_end|>"]]
        turns_ = []
        for _ in range(turns):
            output = [rng.randrange(1000, 5000) for _ in range(6)]
            turns_.append((list(prompt), output))
            prompt = prompt + output + [rng.randrange(1000, 5000) for _ in range(30)]
        out.append(turns_)
    return out


def _write(folder, sessions, order_seed: int, per_file: int):
    """The sessions' requests interleaved in a seeded order (each session's turns stay in order), per_file a pickle."""
    rng = random.Random(order_seed)
    cursors = [0] * len(sessions)
    entries, t = [], 0.0
    while any(c < len(s) for c, s in zip(cursors, sessions)):
        s = rng.choice([i for i, c in enumerate(cursors) if c < len(sessions[i])])
        prompt, output = sessions[s][cursors[s]]
        cursors[s] += 1
        entries.append(entry(prompt, output, t=t))
        t += 1.0
    for k in range(0, len(entries), per_file):
        write_dump(folder / f"2026-01-01_00-00-{k // per_file:02d}.pkl", entries[k:k + per_file])
    return f"sglang-dump:{folder}"


@pytest.fixture
def streaming(monkeypatch):
    monkeypatch.setattr(samples_module, "STREAM_MIN_BYTES", 0)


def _picks(checkpoint, spec, part, samples, seed=0):
    return [tuple(s.tolist()) for s in load_sample_set(checkpoint, spec, part=part, samples=samples,
                                                       seq_len=SEQ_LEN, seed=seed, heldout_fraction=0.3).sequences]


def test_picks_are_full_windows_of_one_served_sequence_split_by_conversation(streaming, tmp_path, kimi_tiktoken_dir,
                                                                            kimi_tokenizer):
    sessions = _sessions(kimi_tokenizer, 12)
    spec = _write(tmp_path / "d", sessions, order_seed=0, per_file=7)
    assert samples_module.streams(spec)
    calibration = _picks(kimi_tiktoken_dir, spec, DataPart.CALIBRATION, 10)
    heldout = _picks(kimi_tiktoken_dir, spec, DataPart.HELDOUT, 4)
    assert len(calibration) == 10 and len(heldout) == 4
    assert all(len(w) == SEQ_LEN for w in calibration + heldout)
    assert not set(calibration) & set(heldout) and len(set(calibration)) == 10

    class Conv:  # split_heldout's rule on the conversation ids group_key gives
        def __init__(self, i):
            from kimi_nvfp4.data.traffic import group_key
            self.id = group_key(sessions[i][0][0], kimi_tokenizer, None)
            self.sequences = [p + o for p, o in sessions[i]]

    cal_convs, held_convs = split_heldout([Conv(i) for i in range(12)], 0.3, 0)

    def inside(window, convs):
        return any(any(tuple(s[k:k + SEQ_LEN]) == window for k in range(len(s))) for c in convs for s in c.sequences)

    assert all(inside(w, cal_convs) for w in calibration)
    assert all(inside(w, held_convs) for w in heldout)


def test_the_pick_does_not_depend_on_file_order_or_file_size(streaming, tmp_path, kimi_tiktoken_dir, kimi_tokenizer):
    sessions = _sessions(kimi_tokenizer, 10)
    a = _write(tmp_path / "a", sessions, order_seed=1, per_file=5)
    b = _write(tmp_path / "b", sessions, order_seed=2, per_file=13)
    for part, n in ((DataPart.CALIBRATION, 8), (DataPart.HELDOUT, 3)):
        assert sorted(_picks(kimi_tiktoken_dir, a, part, n)) == sorted(_picks(kimi_tiktoken_dir, b, part, n))
    assert _picks(kimi_tiktoken_dir, a, DataPart.CALIBRATION, 8, seed=1) != \
        _picks(kimi_tiktoken_dir, a, DataPart.CALIBRATION, 8, seed=0)  # --seed still chooses


def test_too_few_full_windows_is_the_named_error(streaming, tmp_path, kimi_tiktoken_dir, kimi_tokenizer):
    spec = _write(tmp_path / "d", _sessions(kimi_tokenizer, 3), order_seed=0, per_file=50)
    with pytest.raises(DataError, match=r"the calibration part gives \d+ full windows of 32 tokens .*--samples"):
        _picks(kimi_tiktoken_dir, spec, DataPart.CALIBRATION, 500)


def test_memory_is_bounded_by_the_caps_not_by_the_requests(kimi_tokenizer):
    windower = StreamWindower(kimi_tokenizer, SEQ_LEN, samples=4, seed=0, heldout_fraction=0.2, cache_blocks=64,
                              seen_windows=64)
    rng = np.random.default_rng(0)
    requests = (TrafficRequest(f"r{i}", prompt_ids=tuple(int(x) for x in rng.integers(1000, 5000, 200)))
                for i in range(300))
    result = stream_sample_windows(requests, windower)
    assert result.calibration.requests + result.heldout.requests == 300
    assert len(windower.cache) <= 64 and len(windower.seen) <= 64 and result.cache_entries <= 64
    assert len(result.calibration.picks) == 4 and len(result.heldout.picks) == 8  # picks (+ held-out spares) only
    assert result.calibration.full + result.heldout.full > 300  # every request gave windows; few were kept


def test_ids_outside_the_vocabulary_name_the_record(kimi_tokenizer):
    windower = StreamWindower(kimi_tokenizer, SEQ_LEN, samples=1, seed=0, heldout_fraction=0.2, vocab_size=5000)
    with pytest.raises(DataError, match=r"record dump.pkl:3: token id 9999 lies outside"):
        windower.add(TrafficRequest("dump.pkl:3", prompt_ids=(1, 2, 9999)))
