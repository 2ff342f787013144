"""End-to-end calibration of a tiny converted checkpoint: what is written, and what it equals."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from kimi_nvfp4.calibrate import INPUT_SCALES_SHARD, ExpertPolicy, calibrate_checkpoint
from kimi_nvfp4.calibrate.api import quantized_modules, run_calibration
from kimi_nvfp4.calibrate.stats import ActivationCollector
from kimi_nvfp4.checkpoint.manifest import load_manifest
from kimi_nvfp4.checkpoint.reader import INDEX_NAME, CheckpointReader
from kimi_nvfp4.checkpoint.writer import sha256_file
from kimi_nvfp4.model import LayerStreamRunner, NVFP4Weights
from kimi_nvfp4.numerics.constants import NVFP4_TENSOR_SCALE_DENOMINATOR

TINY_SAMPLES = 4
TINY_SEQ_LEN = 48
SAMPLE_DATA = "sample"  # the shipped example sessions


def _calibrate(src, out, **kw):
    kw = {"samples": TINY_SAMPLES, "seq_len": TINY_SEQ_LEN, "device": "cpu", "progress": False, **kw}
    return calibrate_checkpoint(out, src, kw.pop("data", SAMPLE_DATA), **kw)


def _declared(out) -> tuple[str, str, str, bool]:
    """(hf_quant_config quant_algo, config.json quant_algo top / text_config, input_activations declared)."""
    hf = json.loads((out / "hf_quant_config.json").read_text())["quantization"]["quant_algo"]
    config = json.loads((out / "config.json").read_text())
    top, text = config["quantization_config"], config["text_config"]["quantization_config"]
    assert top == text
    return hf, top["quant_algo"], text["quant_algo"], top["config_groups"]["group_0"].get("input_activations") is not None


def test_calibration_switches_the_declared_scheme_from_weight_only_to_w4a4(converted_pair):
    src, out = converted_pair
    assert _declared(out) == ("W4A16_NVFP4", "W4A16_NVFP4", "W4A16_NVFP4", False)  # convert's output
    _calibrate(src, out)
    assert _declared(out) == ("NVFP4", "NVFP4", "NVFP4", True)


def test_calibration_writes_one_small_shard_index_and_manifest(converted_pair):
    src, out = converted_pair
    big_shards = {p.name: sha256_file(p) for p in out.glob("model-0*.safetensors")}
    report = _calibrate(src, out)

    reader = CheckpointReader(out)
    scales = {n: f for n, f in reader.weight_map.items() if n.endswith(".input_scale")}
    expected = {n[: -len(".weight_scale_2")] for n in reader.weight_map if n.endswith(".weight_scale_2")}
    assert {n[: -len(".input_scale")] for n in scales} == expected  # every NVFP4 linear, nothing else
    assert set(scales.values()) == {INPUT_SCALES_SHARD}
    assert report.input_scales == len(expected)
    # the big shards are not rewritten
    assert {p.name: sha256_file(p) for p in out.glob("model-0*.safetensors")} == big_shards
    index = json.loads((out / INDEX_NAME).read_text())
    assert index["metadata"]["total_size"] == sum(reader.info(n).nbytes for n in reader.weight_map)

    manifest = load_manifest(out)
    assert manifest.stages["calibrate"].complete
    assert manifest.shards[INPUT_SCALES_SHARD].sha256 == sha256_file(out / INPUT_SCALES_SHARD)
    assert manifest.stages["calibrate"].settings["policy"] == report.settings.policy

    with safe_open(str(out / INPUT_SCALES_SHARD), "pt") as f:
        for name in f.keys():
            t = f.get_tensor(name)
            assert t.dtype == torch.float32 and t.ndim == 0 and torch.isfinite(t) and float(t) > 0
            if name.endswith("gate_proj.input_scale"):  # gate and up of one expert share the scale
                assert torch.equal(t, f.get_tensor(name.replace("gate_proj", "up_proj")))

    # scale == chosen amax / (6 * 448), as the report says
    layer = next(l for l in report.layers if l.experts is not None)
    prefix = reader.layout.layer_prefix(layer.layer)
    for e, amax in enumerate(layer.experts.gate_up_amax):
        got = float(reader.load(f"{prefix}mlp.experts.{e}.gate_proj.input_scale"))
        assert got == pytest.approx(amax / NVFP4_TENSOR_SCALE_DENOMINATOR, rel=1e-6)

    for name in ("calibration_report.json", "calibration_report.md", "expert_coverage.png", "activation_ranges.png"):
        assert (out / "calibration" / name).stat().st_size > 0
    assert report.tokens > 0 and report.sequences == TINY_SAMPLES
    # the checkpoint now runs as W4A4 without any override
    NVFP4Weights(reader, activations="w4a4").layer(layer.layer, "cpu")


def test_layers_after_the_first_see_quantized_inputs(converted_pair):
    """The statistics of layer L are taken on a stream whose earlier layers ran W4A4 with the new scales."""
    _src, out = converted_pair
    reader = CheckpointReader(out)
    seqs = [torch.randint(0, 5000, (24,), generator=torch.Generator().manual_seed(i)) for i in range(3)]
    run = run_calibration(
        reader, seqs, policy=ExpertPolicy.PEER_MAX, min_expert_tokens=4, device=torch.device("cpu"), progress=False
    )
    moe = [l.layer for l in run.layers if l.experts is not None]
    assert len(moe) >= 2
    second = moe[1]

    # Replay by hand: dense layers W4A16, MoE layers before `second` W4A4 with the run's scales, then observe.
    plain = LayerStreamRunner(NVFP4Weights(reader, activations="w4a16"), progress=False)
    quant = LayerStreamRunner(NVFP4Weights(reader, activations="w4a4", input_scales=run.scales), progress=False)
    states = plain.embed(seqs)
    for layer in range(second):
        states = (quant if layer in moe else plain).apply_layer(layer, states)
    collector = ActivationCollector()
    collector.start_layer(second)
    plain.apply_layer(second, states, observer=collector)
    expected = max(s.amax_value for (m, e), s in collector.routed.items() if e is not None and m.endswith("gate_proj"))
    got = run.layers[second].gate_up_amax_max
    assert got == expected
    # ... and the unquantized stream would have given a different amax
    states = plain.embed(seqs)
    for layer in range(second):
        states = plain.apply_layer(layer, states)
    other = ActivationCollector()
    other.start_layer(second)
    plain.apply_layer(second, states, observer=other)
    unquantized = max(s.amax_value for (m, e), s in other.routed.items() if e is not None and m.endswith("gate_proj"))
    assert unquantized != got


def test_policies_differ_only_for_under_covered_experts(converted_pair):
    _src, out = converted_pair
    reader = CheckpointReader(out)
    seqs = [torch.randint(0, 5000, (20,), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    cpu = torch.device("cpu")
    big = 10**9  # every expert is under-covered
    peer = run_calibration(
        reader, seqs, policy=ExpertPolicy.PEER_MAX, min_expert_tokens=big, device=cpu, progress=False
    )
    full = run_calibration(
        reader, seqs, policy=ExpertPolicy.ROUTE_ALL, min_expert_tokens=big, device=cpu, progress=False
    )
    none = run_calibration(reader, seqs, policy=ExpertPolicy.ROUTE_ALL, min_expert_tokens=0, device=cpu, progress=False)
    layer = next(l for l in peer.layers if l.experts is not None).layer
    p, f, n = peer.layers[layer].experts, full.layers[layer].experts, none.layers[layer].experts
    assert set(p.gate_up_source) == {"peer-max"} and len(set(p.gate_up_amax)) == 1
    assert set(f.gate_up_source) == {"route-all"}
    # all tokens through an expert include its routed tokens: never a smaller amax
    assert all(fa >= na for fa, na, t in zip(f.gate_up_amax, n.gate_up_amax, n.tokens) if t > 0)
    assert set(n.gate_up_source) <= {"routed", "peer-max"}  # min 0: routed wherever the expert saw tokens


def test_recalibration_replaces_the_shard_and_invalidates_validate(converted_pair):
    src, out = converted_pair
    _calibrate(src, out, seed=0)
    from kimi_nvfp4.checkpoint.manifest import StageRecord, save_manifest

    manifest = load_manifest(out)
    manifest.stages["validate"] = StageRecord(complete=True)
    save_manifest(out, manifest)
    first = sha256_file(out / INPUT_SCALES_SHARD)
    _calibrate(src, out, seed=1, samples=2)
    reader = CheckpointReader(out)
    assert sum(1 for n in reader.weight_map if n.endswith(".input_scale")) == len(
        [n for n in reader.weight_map if n.endswith(".weight_scale_2")]
    )
    assert sha256_file(out / INPUT_SCALES_SHARD) != first
    assert "validate" not in load_manifest(out).stages


def test_activation_statistics_are_kept_per_layer(converted_pair):
    src, out = converted_pair
    _calibrate(src, out)
    reader = CheckpointReader(out)
    layer = reader.layout.text.moe_layers[0]
    path = out / "calibration" / "activation_stats" / f"layer_{layer:03d}.safetensors"
    with safe_open(str(path), "pt") as f:
        names = set(f.keys())
        module = reader.layout.layer_prefix(layer) + quantized_modules(reader, layer)[0]
        ms = f.get_tensor(f"{module}.input_mean_square")
        assert ms.ndim == 1 and bool((ms >= 0).all())
        assert f"{module}.input_amax" in names and f"{module}.tokens" in names
