"""vLLM 0.33's own config parsing, W4A16 routing, name mapping and exclusion rules over our outputs (skipped without vLLM)."""

from __future__ import annotations

import pytest

from kimi_nvfp4.engine_check import check_engine

pytestmark = [pytest.mark.usefixtures("vllm_installed"), pytest.mark.engines, pytest.mark.slow]


def _value(report, prefix: str):
    return next(v for v in report.values if v.name.startswith(prefix))


@pytest.mark.parametrize(("fixture", "algo"), [("demo_w4a16", "W4A16_NVFP4"), ("demo_w4a4", "NVFP4")])
def test_vllm_reads_the_declared_scheme_and_keeps_every_tensor(request, fixture, algo, tmp_path):
    report = check_engine(request.getfixturevalue(fixture), "vllm", report_dir=tmp_path)
    assert report.passed, report.misses
    assert report.engine_view["quant_algo (quant_method)"] == algo
    assert report.tensors.routed == report.tensors.in_checkpoint and not report.tensors.dropped
    assert report.modules.nvfp4_modules == 3 and report.modules.by_method["ModelOptNvFp4FusedMoE"] == 3
    assert "apply_vllm_mapper" in " ".join(report.ran)
    if algo == "NVFP4":
        assert _value(report, "W4A4: every NVFP4 linear ships input_scale").passed


def test_vllm_rules_over_the_full_k26(full_size_k26):
    report = check_engine(full_size_k26, "vllm")
    assert report.passed, report.misses[:10]
    assert report.modules.by_method["ModelOptNvFp4FusedMoE"] == 60
    assert report.tensors.routed == report.tensors.in_checkpoint > 270_000
