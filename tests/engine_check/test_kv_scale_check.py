"""The engine check's KV-scale comparison without SGLang: checkpoint names -> `attn_mqa` modules by layer."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from kimi_nvfp4.engine_check.sglang_values import check_kv_cache_scales


def _model(values: dict[int, tuple[float, float]]) -> torch.nn.Module:
    root = torch.nn.Module()
    layers = torch.nn.ModuleList()
    for layer in range(max(values) + 1):
        block = torch.nn.Module()
        block.self_attn = torch.nn.Module()
        block.self_attn.attn_mqa = torch.nn.Module()
        block.self_attn.attn_mha = torch.nn.Module()
        k, v = values.get(layer, (1.0, 1.0))
        block.self_attn.attn_mqa.k_scale_float, block.self_attn.attn_mqa.v_scale_float = k, v
        block.self_attn.attn_mha.k_scale_float = block.self_attn.attn_mha.v_scale_float = 1.0
        layers.append(block)
    root.model = torch.nn.Module()
    root.model.layers = layers
    return root


def _reader(scales: dict[str, float]):
    return SimpleNamespace(weight_map={n: "model-input-scales.safetensors" for n in scales},
                           load=lambda n: torch.tensor(scales[n]))


def _names(layer: int) -> tuple[str, str]:
    p = f"language_model.model.layers.{layer}.self_attn."
    return p + "k_proj.k_scale", p + "v_proj.v_scale"


def test_scales_served_by_their_layers_attn_mqa_pass():
    scales = {n: 2.0 + layer for layer in (0, 1) for n in _names(layer)}
    landed, floor = check_kv_cache_scales(_model({0: (2.0, 2.0), 1: (3.0, 3.0)}), _reader(scales))
    assert landed.passed and landed.checked == 4
    assert floor.passed and floor.checked == 4


def test_a_scale_the_engine_does_not_serve_fails_naming_the_layer():
    scales = {n: 2.0 for layer in (0, 1) for n in _names(layer)}
    landed, _ = check_kv_cache_scales(_model({0: (2.0, 2.0), 1: (1.0, 2.0)}), _reader(scales))
    assert not landed.passed and "layer 1 k_scale" in landed.detail


def test_scales_below_one_land_but_are_flagged_as_misserved():
    """SGLang's MLA decode multiplies every score by k_scale: 0.001 lands bit for bit and still breaks the model."""
    served = float(torch.tensor(0.001))  # SGLang's k_scale_float: the float32 checkpoint value as a Python float
    scales = {n: 0.001 for n in _names(0)}
    landed, floor = check_kv_cache_scales(_model({0: (served, served)}), _reader(scales))
    assert landed.passed
    assert not floor.passed and "layer 0 k_scale 0.001" in floor.detail and "layer 0 v_scale" in floor.detail


def test_no_kv_scales_no_check():
    assert check_kv_cache_scales(_model({0: (1.0, 1.0)}), _reader({})) == []
