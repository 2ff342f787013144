"""The calibration loop's speed work, checked against the plain computation it replaced:
each layer loaded once and attended once, bf16 compute, the compute dtype recorded."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch
from click.testing import CliRunner

from kimi_nvfp4.calibrate import ExpertPolicy, calibrate_checkpoint
from kimi_nvfp4.calibrate.layer_loop import _layer_scales, quantized_modules, run_calibration
from kimi_nvfp4.stage_kit.device import resolve_dtype
from kimi_nvfp4.calibrate.report import CalibrationReport, CalibrationSettings
from kimi_nvfp4.calibrate.stats import ActivationCollector
from kimi_nvfp4.checkpoint.manifest import load_manifest
from kimi_nvfp4.checkpoint.reader import CheckpointReader
from kimi_nvfp4.model import LayerStreamRunner, NVFP4Weights
from kimi_nvfp4.model import runner as runner_module
from kimi_nvfp4.model import weights as model_weights
from kimi_nvfp4.stage_kit.pipeline_stage import settings_match

CPU = torch.device("cpu")


def _seqs(n=3, length=24):
    return [torch.randint(0, 5000, (length + i,), generator=torch.Generator().manual_seed(i)) for i in range(n)]


def reference_calibration(reader, seqs, policy, min_expert_tokens, chunk=None):
    """The loop as it ran before: observe = the whole layer in W4A16, advance = the layer loaded again
    from disk in W4A4 with the new scales (attention recomputed). Same chunks: same matmul shapes."""
    kw = {"progress": False, **({"max_chunk_tokens": chunk} if chunk else {})}
    observe = LayerStreamRunner(NVFP4Weights(reader, activations="w4a16"), **kw)
    states = observe.embed(seqs)
    collector = ActivationCollector()
    scales = {}
    cfg = reader.layout.text
    for layer in range(cfg.num_hidden_layers):
        collector.start_layer(layer)
        modules = quantized_modules(reader, layer)
        collector.route_all = bool(modules) and policy is ExpertPolicy.ROUTE_ALL and cfg.is_moe_layer(layer)
        observed = observe.apply_layer(layer, states, observer=collector)
        layer_scales, _ = _layer_scales(reader, layer, collector, policy=policy, min_expert_tokens=min_expert_tokens)
        if modules:
            scales.update(layer_scales)
            advance = LayerStreamRunner(NVFP4Weights(reader, activations="w4a4", input_scales=layer_scales), **kw)
            states = advance.apply_layer(layer, states)
        else:
            states = observed
    return scales


def _assert_same_bytes(a: dict, b: dict):
    assert a.keys() == b.keys()
    for name, t in a.items():
        assert t.dtype == b[name].dtype == torch.float32
        assert torch.equal(t.view(torch.int32), b[name].view(torch.int32)), name


@pytest.fixture
def counters(monkeypatch):
    """Counts layer loads and attention runs (per layer) during a calibration."""
    seen = {"loads": Counter(), "attention": Counter()}
    load, attend = model_weights._CheckpointWeights.layer, runner_module.attention_block

    def counting_load(source, i, *args, **kwargs):
        seen["loads"][i] += 1
        return load(source, i, *args, **kwargs)

    def counting_attention(cfg, rope, w, x, **kwargs):
        seen["attention"][w.index] += 1
        return attend(cfg, rope, w, x, **kwargs)

    monkeypatch.setattr(model_weights._CheckpointWeights, "layer", counting_load)
    monkeypatch.setattr(runner_module, "attention_block", counting_attention)
    return seen


@pytest.mark.parametrize("policy", list(ExpertPolicy), ids=lambda p: p.value)
@pytest.mark.parametrize("chunk", [None, 16])
def test_each_layer_loaded_and_attended_once_same_scales(converted_pair, counters, policy, chunk):
    _src, out = converted_pair
    reader = CheckpointReader(out)
    seqs = _seqs()
    run = run_calibration(reader, seqs, policy=policy, min_expert_tokens=4, device=CPU, progress=False,
                          max_chunk_tokens=chunk)
    layers = range(reader.layout.text.num_hidden_layers)
    assert counters["loads"] == Counter({i: 1 for i in layers})
    assert counters["attention"] == Counter({i: len(seqs) for i in layers})
    assert run.dtype == "float32" and run.materialized_layers == []  # CPU defaults
    _assert_same_bytes(run.scales, reference_calibration(reader, seqs, policy, 4, chunk))


def test_nvfp4_attention_is_recomputed_in_the_w4a4_pass(attention_nvfp4_pair, counters):
    _src, out, converted = attention_nvfp4_pair
    assert len(converted) == 5
    reader = CheckpointReader(out)
    assert "self_attn.o_proj" in quantized_modules(reader, 0)
    seqs = _seqs()
    run = run_calibration(reader, seqs, policy=ExpertPolicy.PEER_MAX, min_expert_tokens=4, device=CPU,
                          progress=False)
    n = len(seqs)
    # layer 0: attention holds NVFP4 linears -> the W4A4 pass attends again; layer 1's NVFP4 shared expert
    # is inside the MLP: attention once
    assert counters["attention"] == Counter({0: 2 * n, 1: n, 2: n})
    assert counters["loads"] == Counter({0: 1, 1: 1, 2: 1})
    prefix = reader.layout.layer_prefix(0)
    assert f"{prefix}self_attn.o_proj.input_scale" in run.scales
    _assert_same_bytes(run.scales, reference_calibration(reader, seqs, ExpertPolicy.PEER_MAX, 4))


def test_bfloat16_calibration_end_to_end(converted_pair, tmp_path):
    """dtype=bfloat16 (what the CUDA default resolves to) on CPU: recorded, and close to fp32."""
    src, out = converted_pair
    fp32 = run_calibration(CheckpointReader(out), _seqs(4, 60), policy=ExpertPolicy.PEER_MAX, min_expert_tokens=4,
                           device=CPU, progress=False, dtype="float32")
    bf16 = run_calibration(CheckpointReader(out), _seqs(4, 60), policy=ExpertPolicy.PEER_MAX, min_expert_tokens=4,
                           device=CPU, progress=False, dtype="bfloat16")
    assert bf16.dtype == "bfloat16" and bf16.scales.keys() == fp32.scales.keys()
    rel = torch.tensor([abs(float(bf16.scales[k]) / float(fp32.scales[k]) - 1) for k in fp32.scales])
    assert float(rel.median()) < 0.01
    for a, b in zip(fp32.layers, bf16.layers):
        if a.experts is not None:
            # the gate/up scale SGLang's flashinfer backends use (the layer max) within 1%
            assert b.gate_up_amax_max == pytest.approx(a.gate_up_amax_max, rel=0.01)
            # down's input max is one token's SiLU(gate)*up; bf16 rounding can move which expert a
            # near-tie token is routed to, so it moves more on this random tiny model
            assert b.down_amax_max == pytest.approx(a.down_amax_max, rel=0.1)

    report = calibrate_checkpoint(out, src, "sample", samples=2, seq_len=32, device="cpu", progress=False,
                                  dtype="bfloat16")
    assert report.settings.dtype == "bfloat16"
    assert load_manifest(out).stages["calibrate"].settings["dtype"] == "bfloat16"
    saved = json.loads((out / "calibration" / "calibration_report.json").read_text())
    assert saved["settings"]["dtype"] == "bfloat16"
    assert "compute dtype bfloat16" in (out / "calibration" / "calibration_report.md").read_text()


def test_settings_round_trip_and_older_records(converted_pair):
    src, out = converted_pair
    report = calibrate_checkpoint(out, src, "sample", samples=2, seq_len=32, device="cpu", progress=False)
    assert report.settings.dtype == "float32"  # auto on CPU
    recorded = load_manifest(out).stages["calibrate"].settings
    assert CalibrationSettings.model_validate(recorded) == report.settings
    # the pipeline's resume comparison: recorded settings carry dtype, the wanted ones need not
    wanted = {k: recorded[k] for k in ("data", "samples", "seq_len", "seed", "min_expert_tokens", "policy")}
    assert settings_match(recorded, wanted)
    # records written before the field existed still load, as float32 (all such runs were)
    older = {k: v for k, v in recorded.items() if k != "dtype"}
    assert CalibrationSettings.model_validate(older).dtype == "float32"
    saved = json.loads((out / "calibration" / "calibration_report.json").read_text())
    del saved["settings"]["dtype"]
    assert CalibrationReport.model_validate(saved).settings.dtype == "float32"


def test_dtype_resolution_and_cli_option(converted_pair):
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("auto", CPU) == torch.float32
    assert resolve_dtype("bf16", CPU) == torch.bfloat16 and resolve_dtype(torch.float32, CPU) == torch.float32
    with pytest.raises(ValueError, match="dtype"):
        resolve_dtype("float16", CPU)

    from kimi_nvfp4.calibrate.cli import calibrate_command

    src, out = converted_pair
    help_text = CliRunner().invoke(calibrate_command, ["--help"]).output
    assert "--dtype [auto|float32|bfloat16]" in help_text
    bad = CliRunner().invoke(calibrate_command, [str(out), "--source", str(src), "--data", "sample", "--dtype", "fp16"])
    assert bad.exit_code == 2
    ok = CliRunner().invoke(calibrate_command, [str(out), "--source", str(src), "--data", "sample", "--samples", "2",
                                                "--seq-len", "32", "--device", "cpu", "--dtype", "bfloat16",
                                                "--no-progress"])
    assert ok.exit_code == 0, ok.output
    assert load_manifest(out).stages["calibrate"].settings["dtype"] == "bfloat16"


def test_collector_reuses_reductions_only_for_the_same_unmodified_input():
    """gate_proj and up_proj report the same tensor: one set of reductions serves both."""
    collector = ActivationCollector()
    collector.start_layer(1)
    x = torch.randn(5, 16, generator=torch.Generator().manual_seed(0))
    amax = float(x.abs().max())
    collector.on_linear(1, "mlp.experts.0.gate_proj", x, None, expert=0)
    collector.on_linear(1, "mlp.experts.0.up_proj", x, None, expert=0)
    x.mul_(3)  # changed in place (a new version): measured again
    collector.on_linear(1, "mlp.experts.0.down_proj", x, None, expert=0)
    stats = {m: collector.routed[(f"mlp.experts.0.{m}", 0)] for m in ("gate_proj", "up_proj", "down_proj")}
    assert stats["gate_proj"].amax_value == stats["up_proj"].amax_value == amax
    assert stats["down_proj"].amax_value == pytest.approx(3 * amax)
    assert torch.equal(stats["gate_proj"].sum_sq, stats["up_proj"].sum_sq)
    assert all(s.tokens == 5 for s in stats.values())
