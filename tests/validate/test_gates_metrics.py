"""Gate thresholds load from defaults, files and overrides; metrics stream exactly."""

from __future__ import annotations

import json
import math

import pytest
import torch

from kimi_nvfp4.validate.gates import (
    DEFAULT_GATES,
    GateConfigError,
    gate_check,
    gate_max,
    gate_min,
    load_gates,
)
from kimi_nvfp4.validate.metrics import RelativeError, TokenComparison, percentile


def test_defaults_file_and_overrides_compose(tmp_path):
    toml = tmp_path / "gates.toml"
    toml.write_text("weight_rel_mse_max = 0.2\n[w4a4]\nkl_mean_max = 0.5\n")
    g = load_gates(toml, ["w4a16.top1_min=0.5", "w4a4.kl_mean_max=0.25"])
    assert g.weight_rel_mse_max == 0.2
    assert g.w4a4.kl_mean_max == 0.25  # the command line wins over the file
    assert g.w4a16.top1_min == 0.5
    assert g.w4a4.kl_p99_max == DEFAULT_GATES.w4a4.kl_p99_max
    js = tmp_path / "gates.json"
    js.write_text(json.dumps({"w4a16": {"drift_max": 1.0}}))
    assert load_gates(js).w4a16.drift_max == 1.0


@pytest.mark.parametrize(
    "override, message",
    [
        ("w4a4.nope=1", "no such threshold"),
        ("kl_mean_max", "KEY=VALUE"),
        ("w4a4.kl_mean_max=abc", "not a number"),
        ("w4a4=1", "no such threshold"),
        ("w4a4.kl_mean_max=inf", "finite"),
    ],
)
def test_bad_overrides_are_named(override, message):
    with pytest.raises(GateConfigError, match=message):
        load_gates(None, [override])


def test_bad_gate_files(tmp_path):
    with pytest.raises(GateConfigError, match="does not exist"):
        load_gates(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("unknown_key = 1\n")
    with pytest.raises(GateConfigError, match="unknown threshold 'unknown_key'"):
        load_gates(bad)


def test_gate_verdicts_and_margins():
    assert gate_max("kl", 0.1, 0.2).passed and not gate_max("kl", 0.3, 0.2).passed
    assert gate_max("kl", 0.3, 0.2).margin == pytest.approx(0.1)
    assert not gate_max("kl", math.nan, 0.2).passed
    assert gate_min("top1", 0.8, 0.9).margin == pytest.approx(0.1) and not gate_min("top1", 0.8, 0.9).passed
    assert gate_check("s", []).passed and "a; b" in gate_check("s", ["a", "b"]).detail


def test_relative_error_streams():
    a, b = torch.randn(50, 8), torch.randn(50, 8)
    acc = RelativeError()
    for x, y in zip(a.split(9), b.split(9)):
        acc.add(x, y)
    expected = float(((a.double() - b.double()) ** 2).sum() / (a.double() ** 2).sum())
    assert acc.rel_mse == pytest.approx(expected)
    assert RelativeError().rel_mse == 0.0


def test_token_comparison_identical_and_different_models():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(12, 20, generator=g)
    tokens = torch.randint(0, 20, (12,), generator=g)
    same = TokenComparison()
    same.add(logits, logits.clone(), tokens)
    assert same.kl_mean == pytest.approx(0.0, abs=1e-6) and same.top1 == 1.0 and same.ppl_ratio == pytest.approx(1.0)
    diff = TokenComparison()
    other = torch.randn(12, 20, generator=g)
    diff.add(logits, other, tokens)
    p, q = logits.log_softmax(-1), other.log_softmax(-1)
    kl = (p.exp() * (p - q)).sum(-1)
    assert diff.kl_mean == pytest.approx(float(kl.mean()), rel=1e-5)
    assert diff.kl_p99 == pytest.approx(float(kl.max()), rel=1e-5)  # 12 values: p99 is the max
    nll_p = -float(p[:-1].gather(1, tokens[1:, None]).sum()) / 11
    assert diff.ppl_ref == pytest.approx(math.exp(nll_p), rel=1e-5)
    edges, counts = diff.kl_histogram(10)
    assert len(edges) == 11 and sum(counts) == 12


def test_percentile_nearest_rank():
    v = torch.arange(1, 101, dtype=torch.float32)
    assert percentile(v, 0.99) == 99.0 and percentile(v, 1.0) == 100.0 and percentile(torch.zeros(0), 0.5) == 0.0
