"""FP8 KV-cache scales: what the MLA cache holds per layer, Model Optimizer's value rule, the names engines map."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open

from kimi_nvfp4.calibrate import INPUT_SCALES_SHARD, calibrate_checkpoint
from kimi_nvfp4.calibrate.kv_cache import (
    KVCacheRanges,
    check_kv_cache_scale,
    declared_kv_cache_algo,
    fake_quant_fp8,
    is_kv_cache_scale,
    kv_scale_from_amax,
    kv_scale_names,
)
from kimi_nvfp4.calibrate.shard import install_input_scales, misplaced_input_scales
from kimi_nvfp4.checkpoint.reader import CheckpointReader
from kimi_nvfp4.convert.api import convert_checkpoint
from kimi_nvfp4.errors import CheckpointError
from kimi_nvfp4.model import NVFP4Weights
from kimi_nvfp4.model.attention import mla_attention, rms_norm
from kimi_nvfp4.model.rope import RotaryEmbedding
from kimi_nvfp4.stage_kit.samples import DataPart, load_sample_set

SAMPLES, SEQ_LEN, DATA, SEED = 4, 48, "sample", 0


def _calibrate(src, out, **kw):
    return calibrate_checkpoint(out, src, DATA, samples=SAMPLES, seq_len=SEQ_LEN, seed=SEED, device="cpu",
                                progress=False, **kw)


def test_scale_is_amax_over_448_and_never_below_one():
    assert kv_scale_from_amax(0.0) == 1.0
    assert kv_scale_from_amax(3.25) == 1.0  # a layernormed latent: Model Optimizer's clamp keeps 1.0
    assert kv_scale_from_amax(448.0) == 1.0
    assert kv_scale_from_amax(896.0) == 2.0
    assert kv_scale_from_amax(1000.0) == pytest.approx(1000.0 / 448.0)


def test_fake_quant_rounds_to_e4m3_saturates_and_scales():
    grid = torch.tensor([0.0, -0.0, 0.015625, 1.0, 1.125, -3.5, 240.0, 448.0, -448.0])
    assert torch.equal(fake_quant_fp8(grid, 1.0), grid)  # E4M3 values pass unchanged
    assert torch.equal(fake_quant_fp8(torch.tensor([1.0625, 1.1875]), 1.0), torch.tensor([1.0, 1.25]))  # ties to even
    assert torch.equal(fake_quant_fp8(torch.tensor([1000.0, -1e6]), 1.0), torch.tensor([448.0, -448.0]))
    assert torch.equal(fake_quant_fp8(torch.tensor([896.0, 2.25]), 2.0), torch.tensor([896.0, 2.25]))
    x = torch.randn(1000, dtype=torch.bfloat16)
    assert fake_quant_fp8(x, 1.0).dtype == torch.bfloat16


def test_ranges_are_the_amax_of_the_cached_latent_and_rope_key(converted_pair):
    _src, out = converted_pair
    weights = NVFP4Weights(CheckpointReader(out), activations="w4a16")
    cfg = weights.config
    w = weights.layer(1, "cpu", torch.float32)
    rope = RotaryEmbedding.from_config(cfg)
    x = torch.randn(2, 19, cfg.hidden_size)
    ranges = KVCacheRanges()
    past = None
    for chunk in x:  # two calls: the second appends to the cache; each row is counted once
        _o, past = mla_attention(cfg, rope, w.self_attn, chunk, layer=1, past=past, observer=ranges)
    assert ranges.layers() == [1] and ranges.tokens[1] == 38
    assert float(ranges.latent[1]) == float(past.latent.abs().max())
    assert float(ranges.rope[1]) == float(past.k_pe.abs().max())
    assert ranges.amax(1) == max(float(past.latent.abs().max()), float(past.k_pe.abs().max()))


def test_calibrate_writes_k_and_v_scales_for_every_layer_from_what_the_cache_held(converted_pair):
    src, out = converted_pair
    report = _calibrate(src, out)
    reader = CheckpointReader(out)
    layout, cfg = reader.layout, reader.layout.text
    assert report.kv_cache is not None and report.kv_cache.kv_cache_quant_algo == "FP8"
    assert [e.layer for e in report.kv_cache.layers] == list(range(cfg.num_hidden_layers))
    assert report.kv_cache.tensors == 2 * cfg.num_hidden_layers
    with safe_open(str(out / INPUT_SCALES_SHARD), "pt") as f:
        stored = {n: f.get_tensor(n) for n in f.keys() if is_kv_cache_scale(n)}
    for entry in report.kv_cache.layers:
        k_name, v_name = kv_scale_names(layout, entry.layer)
        # Model Optimizer's names under the checkpoint's text prefix, in the calibration shard
        assert k_name == f"language_model.model.layers.{entry.layer}.self_attn.k_proj.k_scale"
        assert v_name == f"language_model.model.layers.{entry.layer}.self_attn.v_proj.v_scale"
        assert reader.weight_map[k_name] == reader.weight_map[v_name] == INPUT_SCALES_SHARD
        for name in (k_name, v_name):
            assert stored[name].dtype == torch.float32 and stored[name].ndim == 0
            assert float(stored[name]) == kv_scale_from_amax(entry.amax) == entry.scale
        assert entry.amax == max(entry.latent_amax, entry.rope_amax) > 0
        assert entry.unclamped_scale == pytest.approx(entry.amax / 448.0)
        assert entry.tokens == report.tokens
    assert set(stored) == {n for e in report.kv_cache.layers for n in kv_scale_names(layout, e.layer)}

    # layer 0 sees the embeddings whatever the quantization: recompute its cache from the same sequences
    samples = load_sample_set(out, DATA, part=DataPart.CALIBRATION, samples=SAMPLES, seq_len=SEQ_LEN, seed=SEED)
    weights = NVFP4Weights(reader, activations="w4a16")
    w = weights.layer(0, "cpu", torch.float32)
    table = weights.embed("cpu").to(torch.float32)
    rope = RotaryEmbedding.from_config(cfg)
    latent = rope_key = 0.0
    for ids in samples.sequences:
        x = rms_norm(table[torch.as_tensor(ids).reshape(-1)], w.input_layernorm, cfg.rms_norm_eps)
        _o, cache = mla_attention(cfg, rope, w.self_attn, x, layer=0)
        latent = max(latent, float(cache.latent.abs().max()))
        rope_key = max(rope_key, float(cache.k_pe.abs().max()))
    first = report.kv_cache.layers[0]
    assert first.latent_amax == pytest.approx(latent, rel=1e-6)
    assert first.rope_amax == pytest.approx(rope_key, rel=1e-6)
    saved = json.loads((out / "calibration" / "calibration_report.json").read_text())
    assert saved["kv_cache"]["layers"][0]["amax"] == first.amax


def test_kv_cache_none_writes_no_kv_scales(tmp_path, converted_pair):
    src, _ = converted_pair
    out = tmp_path / "no_kv"
    convert_checkpoint(src, out, device="cpu", progress=False, kv_cache_quant_algo="none")
    assert declared_kv_cache_algo(out) is None
    report = _calibrate(src, out)
    assert report.kv_cache is None
    reader = CheckpointReader(out)
    assert not [n for n in reader.weight_map if is_kv_cache_scale(n)]
    assert reader.weight_map  # the input scales are there as usual
    assert any(n.endswith(".input_scale") for n in reader.weight_map)


def test_kv_scales_are_refused_for_unknown_layers_and_below_one(converted_pair):
    _src, out = converted_pair
    reader = CheckpointReader(out)
    k_name, _ = kv_scale_names(reader.layout, 0)
    with pytest.raises(CheckpointError, match="no MLA attention"):
        check_kv_cache_scale(reader, k_name.replace("layers.0.", "layers.99."), torch.tensor(1.0))
    with pytest.raises(ValueError, match=">= 1"):
        check_kv_cache_scale(reader, k_name, torch.tensor(0.5))
    with pytest.raises(ValueError, match="float32"):
        check_kv_cache_scale(reader, k_name, torch.tensor(1.0, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=">= 1"):
        install_input_scales(out, {k_name: torch.tensor(0.01)}, stage_settings={})
    assert not (out / INPUT_SCALES_SHARD).exists()  # nothing written


def test_kv_scales_in_a_main_shard_count_as_misplaced(converted_pair):
    """A KV scale may live only in the calibration shard (engines load every indexed shard)."""
    _src, out = converted_pair
    reader = CheckpointReader(out)
    k_name, v_name = kv_scale_names(reader.layout, 0)
    main = sorted(set(reader.weight_map.values()))[0]
    view = SimpleNamespace(weight_map={**reader.weight_map, k_name: main, v_name: INPUT_SCALES_SHARD})
    assert misplaced_input_scales(view) == [k_name]


class _TwoRanks:
    """A rank of a two-rank run whose peer saw `peer` (a KVCacheRanges): the collectives combine with it."""

    distributed = True

    def __init__(self, peer: KVCacheRanges):
        self.peer = peer

    def all_gather_object(self, obj):
        if isinstance(obj, dict):
            return [obj, dict(self.peer.tokens)]
        return [obj, sorted(self.peer.latent)]

    def all_reduce_max_(self, t):
        layers = sorted(set(self.peer.latent) | set(self.peer.rope))
        zero = torch.zeros(())
        table = self.peer.latent if self._latent_turn else self.peer.rope
        self._latent_turn = not self._latent_turn
        return torch.maximum(t, torch.stack([table.get(i, zero) for i in layers]))

    _latent_turn = True


def test_ranks_combine_to_the_max_over_all_tokens():
    mine, peer = KVCacheRanges(), KVCacheRanges()
    mine.on_kv_cache(0, torch.full((3, 4), 2.0), torch.full((3, 2), 1.0))
    peer.on_kv_cache(0, torch.full((5, 4), 1.0), torch.full((5, 2), -6.0))
    peer.on_kv_cache(1, torch.full((5, 4), 0.5), torch.full((5, 2), 0.25))
    mine.combine_ranks(_TwoRanks(peer))
    assert mine.layers() == [0, 1]
    assert (float(mine.latent[0]), float(mine.rope[0]), mine.amax(0)) == (2.0, 6.0, 6.0)
    assert (float(mine.latent[1]), float(mine.rope[1])) == (0.5, 0.25)
    assert mine.tokens == {0: 8, 1: 5}
