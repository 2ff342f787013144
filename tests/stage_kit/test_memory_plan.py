"""The model stages' memory planner (kimi_nvfp4/stage_kit/memory_plan.py) at Kimi K2.6's real dimensions.

Nothing here allocates: plans are made for a K2.6-shaped config on budgets given explicitly (--gpu-memory), as a
dry run does, so the H200 (139 GiB), an 80 GB and a 48 GB GPU are all planned on CI's CPU. How close the estimate
is to a measured peak is a benchmark (bench/profile/memory_plan.py), not a test.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from kimi_nvfp4.checkpoint.k2_config import K2Config
from kimi_nvfp4.cli import cli, main
from kimi_nvfp4.errors import ResourceError
from kimi_nvfp4.model.moe import DEQUANTIZED_GROUP_BYTES
from kimi_nvfp4.stage_kit.memory_estimate import GIB, GPU_HEADROOM_BYTES, LayerSizes, _chunk_bytes, estimate
from kimi_nvfp4.stage_kit.memory_plan import MemoryPlan, parse_bytes, plan_memory
from kimi_nvfp4.synth.configs import deepseek_v3_text_config

K26 = K2Config.from_dict(deepseek_v3_text_config("k2.6", layers=61, experts=384))
CUDA = torch.device("cuda")
HOST = 1000 * GIB
DEFAULT_TOKENS = 512 * 2048


def _plan(stage="validate", gpu="139GiB", tokens=DEFAULT_TOKENS, **kw) -> MemoryPlan:
    baseline = kw.pop("baseline", stage == "validate")
    streams, sources = (3 + baseline, 2) if stage == "validate" else (1, 1)
    return plan_memory(K26, stage=stage, device=kw.pop("device", CUDA), dtype=torch.bfloat16, tokens=tokens,
                       seq_len=2048, streams=streams, sources=sources, gpu_memory=parse_bytes(gpu),
                       host_memory=kw.pop("host", HOST), default_chunk_tokens=65536, baseline=baseline, **kw)


def _estimate(stage="validate", tokens=DEFAULT_TOKENS, chunk=32768, prefetch=False, materialize=False, cfg=K26,
              **kw):
    """`estimate` for K2.6 (or `cfg`) in bf16 on CUDA, states on the GPU: validate's 4 streams over 2 checkpoints with
    the baseline, calibrate's 1 over 1."""
    validate = stage == "validate"
    kw.setdefault("streams", 4 if validate else 1)
    return estimate(cfg, stage=stage, device=CUDA, dtype=torch.bfloat16, tokens=tokens, seq_len=2048,
                    sources=2 if validate else 1, states_on_device=kw.pop("on_device", True), chunk_tokens=chunk,
                    materialize=materialize, prefetch=prefetch, baseline=kw.pop("baseline", validate), **kw)


def test_sizes_are_k26s():
    size = LayerSizes(K26, 2)
    # 384 experts x 3 x 7168 x 2048 weights at 4.5 bits; 31.5 GiB decoded to bf16; lm_head 163840 x 7168 bf16
    assert size.experts_stored == 384 * 3 * 7168 * 2048 * 9 // 16
    assert size.experts_materialized == pytest.approx(31.5 * GIB)
    assert size.lm_head == 163840 * 7168 * 2


FITS = [(stage, baseline, gpu) for stage, baseline in [("calibrate", False), ("validate", True), ("validate", False)]
        for gpu in ["139GiB", "80GiB", "48GiB"]]


@pytest.mark.parametrize("stage,baseline,gpu", FITS)
@pytest.mark.parametrize("samples", [96, 256, 512])
def test_defaults_fit_every_gpu_within_its_budget(stage, baseline, gpu, samples):
    plan = _plan(stage, gpu, tokens=samples * 2048, baseline=baseline)
    assert plan.estimated_peak_gpu_bytes <= parse_bytes(gpu)
    assert plan.estimated_peak_host_bytes <= HOST
    assert plan.chunk_tokens >= 4096


def test_the_baseline_conversion_holds_one_unpacked_expert():
    """`baseline_layer` unpacks and converts one expert at a time: its build term is one expert's int8 codes and fp32
    group scales (47 MiB at K2.6), not the layer's 17.7 GiB, so validate with the baseline fits 48 GiB."""
    size = LayerSizes(K26, 2)
    plan = _plan("validate", "48GiB", tokens=96 * 2048)
    assert plan.components["baseline_build"] == size.expert_values * 9 // 8 // 384
    assert plan.estimated_peak_gpu_bytes <= 48 * GIB
    assert _plan("validate", "48GiB", tokens=96 * 2048, baseline=False).components["baseline_build"] == 0


def test_what_gives_way_first_is_materialize_then_chunks_then_states():
    roomy = _plan("calibrate", "139GiB", tokens=96 * 2048)
    assert roomy.materialize and roomy.prefetch and roomy.states_device == "cuda" and roomy.chunk_tokens == 65536
    tight = _plan("validate", "139GiB")
    assert not tight.materialize and tight.states_device == "cuda"
    small = _plan("validate", "80GiB")
    assert small.states_on_host and small.estimated_peak_host_bytes > 4 * 14 * GIB
    assert _plan("validate", "48GiB", baseline=False).states_on_host


def test_explicit_settings_are_kept_or_refused_with_what_fits():
    kept = _plan("validate", "139GiB", tokens=96 * 2048, chunk_tokens=8192)
    assert kept.chunk_tokens == 8192
    with pytest.raises(ResourceError, match=r"without the explicit setting it fits: --max-chunk-tokens \d+ "
                                            r"--states-device cpu"):
        _plan("validate", "80GiB", states_device="cuda")


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


def test_validate_counts_what_its_int4_stream_holds():
    """Validate at 512 x 2048 in chunks of 32,768 (the H200's plan): its peak is the INT4 stream's MoE chunks, with
    every stream plus the INT4 input (`new_ref`), both layers, the baseline's experts and the INT4 chunk's 50 bytes per
    (token x hidden) value: input, previous output and norm (3 x 2), the sorted rows the expert check's view keeps
    (8 x 2), the expert outputs (8 x 2) and the fp32 combine (12) -- not the shared 88."""
    size = LayerSizes(K26, 2)
    stream = DEFAULT_TOKENS * 7168 * 2
    gpu, _host, comp = _estimate()
    assert comp["chunk_work"] == 50 * 32768 * 7168 and _chunk_bytes(K26, 32768, 2) == 88 * 32768 * 7168
    assert comp["baseline_experts"] == size.experts_stored  # never dequantized
    assert "previous_layer_experts" not in comp  # freed with the layer (validate/streams.py _drop_dequantized_experts)
    assert comp["baseline_build"] == size.expert_values * 9 // 8 // 384  # one expert: int8 codes + fp32 scales per 32
    # not dequantized once: a group of experts is decoded for each grouped launch (moe.py _expert_products)
    assert comp["experts_decoded_per_chunk"] == DEQUANTIZED_GROUP_BYTES
    assert gpu == 5 * stream + 2 * size.stored + size.experts_stored + comp["chunk_work"] + DEQUANTIZED_GROUP_BYTES \
        + GPU_HEADROOM_BYTES
    # dequantized layers: the prefetch thread dequantizes the next ones too (runner.py `_load`), the baseline never
    _gpu, _host, mat = _estimate(materialize=True, prefetch=True)
    assert mat["next_layers_prefetched"] == 2 * (size.stored + size.experts_materialized)
    assert mat["baseline_experts"] == size.experts_stored


def test_the_baseline_conversion_is_not_validates_peak_even_on_few_tokens():
    """With one expert unpacked at a time, the baseline's conversion holds less than the INT4 stream's chunks even on
    the baseline's fewest tokens (8 x 2048): the peak is the layer phase -- every stream plus the INT4 input, both
    layers and the next ones, the baseline's experts and the chunk."""
    size = LayerSizes(K26, 2)
    tokens = 8 * 2048
    gpu, _host, comp = _estimate(tokens=tokens, chunk=65536, prefetch=True)
    assert gpu == 5 * tokens * 7168 * 2 + 4 * size.stored + size.experts_stored + comp["chunk_work"] \
        + comp["experts_decoded_per_chunk"] + GPU_HEADROOM_BYTES


def test_validate_logits_count_every_stream():
    """After the last layer every stream is still read (not one more), and one sequence's logits are held 4 + 2
    times in bf16 plus 5 fp32 values (validate/metrics.py)."""
    cfg = dataclasses.replace(K26, n_routed_experts=8)  # small layers: the logits are the peak
    size = LayerSizes(cfg, 2)
    gpu, _host, comp = _estimate(tokens=2048, cfg=cfg)
    assert comp["logits_work"] == 2 * size.lm_head + ((4 + 2) * 2 + 5 * 4) * 2048 * cfg.vocab_size
    assert gpu == 4 * 2048 * 7168 * 2 + comp["logits_work"] + GPU_HEADROOM_BYTES


def test_calibrates_estimate_is_its_own():
    """Calibrate keeps the shared accounting: states + residual, the layer, the next one, one dequantized layer and
    the shared chunk formula."""
    size = LayerSizes(K26, 2)
    gpu, _host, comp = _estimate("calibrate", chunk=65536, prefetch=True, materialize=True)
    assert comp["chunk_work"] == _chunk_bytes(K26, 65536, 2)
    assert gpu == 2 * DEFAULT_TOKENS * 7168 * 2 + 2 * size.stored + size.experts_materialized + comp["chunk_work"] \
        + GPU_HEADROOM_BYTES


RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"


# Measured with validate as it is now (the older files' runs held the previous MoE layer's experts and unpacked a
# whole layer for the baseline, which validate no longer does: docs/benchmarks.md §16)
@pytest.mark.parametrize("name", ["memory_plan_baseline_per_expert_h200.json"])
def test_validates_estimate_is_not_below_a_recorded_peak(name):
    """The direction that matters (a plan below the peak runs out of memory): for every validate case the H200
    recorded (bench/profile/memory_plan.py, K2.6-shaped layers of 384 experts), the estimate for the recorded plan's
    settings is at least the allocated peak measured."""
    for case in json.loads((RESULTS / name).read_text())["results"]:
        p = case["plan"]
        if p["stage"] != "validate":
            continue
        gpu, _host, _comp = _estimate(tokens=p["tokens"], chunk=p["chunk_tokens"], prefetch=p["prefetch"],
                                      materialize=p["materialize"], on_device=p["states_device"] != "cpu",
                                      streams=p["streams"])
        assert gpu >= case["peak_allocated_bytes"], (case["samples"], case["cap"])
