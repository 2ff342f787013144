"""The model stages' layer bar: every layer once, the job's tokens per second in its postfix."""

from __future__ import annotations

import io

from kimi_nvfp4.distributed import RankContext
from kimi_nvfp4.stage_kit import progress as progress_mod
from kimi_nvfp4.stage_kit.progress import format_rate, job_tokens, layer_progress


def test_every_layer_is_yielded_once_in_order():
    assert list(layer_progress(range(5), tokens_per_layer=100, desc="x", enabled=False)) == [0, 1, 2, 3, 4]


def test_the_bar_shows_tokens_per_second(monkeypatch):
    clock = iter([0.0, 2.0, 10.0, 10.5])  # layer 0 takes 2 s, layer 1 takes 0.5 s
    monkeypatch.setattr(progress_mod, "_clock", lambda: next(clock))
    out = io.StringIO()
    real = progress_mod.tqdm
    monkeypatch.setattr(progress_mod, "tqdm", lambda **kw: real(file=out, mininterval=0, **kw))
    list(layer_progress(["a", "b"], tokens_per_layer=4000, desc="calibrate: layers", enabled=True))
    text = out.getvalue()
    assert "calibrate: layers" in text and "2/2" in text
    assert "8.0k tok/s" in text  # the last layer's rate: 4000 tokens in 0.5 s


def test_rates_read_naturally():
    assert format_rate(512) == "512 tok/s"
    assert format_rate(85_300) == "85.3k tok/s"
    assert format_rate(2_450_000) == "2.45M tok/s"


def test_one_process_counts_its_own_tokens():
    assert job_tokens(RankContext(), 1234) == 1234
