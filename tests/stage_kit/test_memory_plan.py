"""The model stages' memory planner (kimi_nvfp4/stage_kit/memory_plan.py) at Kimi K2.6's real dimensions.

Nothing here allocates: plans are made for a K2.6-shaped config on budgets given explicitly (--gpu-memory), as a
dry run does, so the H200 (139 GiB), an 80 GB and a 48 GB GPU are all planned on CI's CPU. How close the estimate
is to a measured peak is a benchmark (bench/profile/memory_plan.py), not a test.
"""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from kimi_nvfp4.checkpoint.k2_config import K2Config
from kimi_nvfp4.cli import cli, main
from kimi_nvfp4.errors import ResourceError
from kimi_nvfp4.stage_kit.memory_plan import GIB, LayerSizes, MemoryPlan, parse_bytes, plan_memory
from kimi_nvfp4.synth.configs import deepseek_v3_text_config

K26 = K2Config.from_dict(deepseek_v3_text_config("k2.6", layers=61, experts=384))
CUDA = torch.device("cuda")
HOST = 1000 * GIB
DEFAULT_TOKENS = 512 * 2048


def _plan(stage="validate", gpu="139GiB", tokens=DEFAULT_TOKENS, **kw) -> MemoryPlan:
    streams, sources = (4, 2) if stage == "validate" else (1, 1)
    return plan_memory(K26, stage=stage, device=kw.pop("device", CUDA), dtype=torch.bfloat16, tokens=tokens,
                       seq_len=2048, streams=streams, sources=sources, gpu_memory=parse_bytes(gpu),
                       host_memory=kw.pop("host", HOST), default_chunk_tokens=65536, baseline=stage == "validate",
                       **kw)


def test_sizes_are_k26s():
    size = LayerSizes(K26, 2)
    # 384 experts x 3 x 7168 x 2048 weights at 4.5 bits; 31.5 GiB decoded to bf16; lm_head 163840 x 7168 bf16
    assert size.experts_stored == 384 * 3 * 7168 * 2048 * 9 // 16
    assert size.experts_materialized == pytest.approx(31.5 * GIB)
    assert size.lm_head == 163840 * 7168 * 2


@pytest.mark.parametrize("gpu", ["139GiB", "80GiB", "48GiB"])
@pytest.mark.parametrize("stage", ["calibrate", "validate"])
@pytest.mark.parametrize("samples", [96, 256, 512])
def test_defaults_fit_every_gpu_within_its_budget(stage, gpu, samples):
    plan = _plan(stage, gpu, tokens=samples * 2048)
    assert plan.estimated_peak_gpu_bytes <= parse_bytes(gpu)
    assert plan.estimated_peak_host_bytes <= HOST
    assert plan.chunk_tokens >= 4096


def test_what_gives_way_first_is_materialize_then_chunks_then_states():
    roomy = _plan("calibrate", "139GiB", tokens=96 * 2048)
    assert roomy.materialize and roomy.prefetch and roomy.states_device == "cuda" and roomy.chunk_tokens == 65536
    tight = _plan("validate", "139GiB")
    assert not tight.materialize and tight.states_device == "cuda"
    small = _plan("validate", "48GiB")
    assert small.states_on_host and small.estimated_peak_host_bytes > 4 * 14 * GIB


def test_explicit_settings_are_kept_or_refused_with_what_fits():
    kept = _plan("validate", "139GiB", tokens=96 * 2048, chunk_tokens=8192)
    assert kept.chunk_tokens == 8192
    with pytest.raises(ResourceError, match=r"without the explicit setting it fits: --max-chunk-tokens \d+ "
                                            r"--states-device cpu"):
        _plan("validate", "48GiB", states_device="cuda")


def test_nothing_fits_names_the_need_and_the_budget():
    with pytest.raises(ResourceError, match=r"validate: 4 stream\(s\) of 1,048,576 tokens on cuda do not fit: .*"
                                            r"budget 16\.0 GiB.*fewer --samples"):
        _plan("validate", "16GiB", host=64 * GIB)


def test_cpu_plans_hold_everything_on_the_host():
    plan = _plan("calibrate", "1GiB", device=torch.device("cpu"), tokens=4096)
    assert plan.estimated_peak_gpu_bytes is None and plan.states_device == "cpu" and not plan.materialize


@pytest.mark.parametrize("text,expected", [("80GiB", 80 * GIB), ("80G", 80 * GIB), ("48GB", 48 * 10**9),
                                           ("1.5TiB", int(1.5 * 2**40)), ("4096", 4096), (123, 123)])
def test_sizes_parse(text, expected):
    assert parse_bytes(text) == expected


def test_bad_size_is_refused():
    with pytest.raises(ValueError, match="not a size"):
        parse_bytes("lots")


def test_dry_run_plans_an_absent_gpu_without_reading_weights(tmp_path, make_tiny_k2, capsys):
    src = make_tiny_k2(tmp_path / "src")
    for shard in src.glob("*.safetensors"):
        shard.write_bytes(b"")  # a dry run reads the config alone
    result = CliRunner().invoke(cli, ["calibrate", str(src), "--source", str(src), "--data", "sample", "--dry-run",
                                       "--device", "cuda", "--gpu-memory", "80GiB"])
    assert result.exit_code == 0, result.output
    plan = MemoryPlan.model_validate(json.loads(result.output))
    assert plan.device == "cuda" and plan.gpu_budget_bytes == 80 * GIB and plan.tokens == 512 * 2048
    with pytest.raises(SystemExit) as refused:
        main(["validate", str(src), "--source", str(src), "--data", "sample", "--report", str(tmp_path / "r"),
              "--dry-run", "--device", "cuda", "--gpu-memory", "1GB"])
    assert refused.value.code == 10 and "do not fit" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()
