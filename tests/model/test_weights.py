"""Weight sources: per-layer loading, format detection, shape checks, NVFP4 emulation rules."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from kimi_nvfp4.errors import CheckpointError
from kimi_nvfp4.model import (
    Int4SourceWeights,
    LayerStreamRunner,
    NVFP4Weights,
    detect_checkpoint_kind,
    open_weights,
)
from kimi_nvfp4.model.layer_weights import MLPWeights, MoEWeights
from kimi_nvfp4.model.linear import ActivationMode, DenseLinear, Int4Linear, NVFP4Linear
from kimi_nvfp4.numerics.int4 import dequantize_int4
from kimi_nvfp4.numerics.nvfp4 import dequantize_nvfp4, fake_quantize_activation_nvfp4

GEN = torch.Generator().manual_seed(0)


def test_int4_layer_holds_exact_int4_values(tiny_src):
    source = open_weights(tiny_src)
    assert isinstance(source, Int4SourceWeights)
    layer = source.layer(1, "cpu")
    assert isinstance(layer.mlp, MoEWeights) and len(layer.mlp.experts) == source.config.n_routed_experts
    lin = layer.mlp.experts[3].down_proj
    assert isinstance(lin, Int4Linear) and lin.module == "mlp.experts.3.down_proj"
    prefix = "language_model.model.layers.1.mlp.experts.3.down_proj"
    expected = dequantize_int4(
        source.reader.load(f"{prefix}.weight_packed"), source.reader.load(f"{prefix}.weight_scale"), lin.in_features
    )
    assert torch.equal(lin.weight(), expected)
    assert isinstance(layer.self_attn.o_proj, DenseLinear)
    dense0 = source.layer(0, "cpu")
    assert isinstance(dense0.mlp, MLPWeights) and dense0.mlp.gate_proj.module == "mlp.gate_proj"


def test_detect_kind(tiny_src, tiny_nvfp4):
    from kimi_nvfp4.checkpoint.reader import CheckpointReader

    assert detect_checkpoint_kind(CheckpointReader(tiny_src)) == "int4"
    assert detect_checkpoint_kind(CheckpointReader(tiny_nvfp4)) == "nvfp4"
    assert isinstance(open_weights(tiny_nvfp4, activations="w4a16"), NVFP4Weights)


def test_wrong_kind_is_refused(tiny_src, tiny_nvfp4):
    with pytest.raises(CheckpointError, match="is an NVFP4 .*NVFP4Weights") as e:
        open_weights(tiny_nvfp4, kind="int4").layer(1, "cpu")
    assert "mlp.experts.0.gate_proj.weight" in str(e.value) and "model-00001-of-000001" in str(e.value)
    with pytest.raises(CheckpointError, match="is an INT4 .*Int4SourceWeights"):
        open_weights(tiny_src, kind="nvfp4", activations="w4a16").layer(1, "cpu")
    with pytest.raises(TypeError):
        open_weights(tiny_src, kind="int4", activations="w4a4")


def test_shape_mismatch_names_file_and_tensor(tiny_src, copy_checkpoint):
    ckpt = copy_checkpoint(tiny_src)
    config = json.loads((ckpt / "config.json").read_text())
    config["text_config"]["moe_intermediate_size"] = 64
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"weight_shape \[32, 64\] does not match the config's \[64, 64\]") as e:
        open_weights(ckpt).layer(1, "cpu")
    assert "language_model.model.layers.1.mlp.experts.0.gate_proj.weight_shape" in str(e.value)
    assert ".safetensors" in str(e.value)


def test_w4a16_experts_are_dequantized_nvfp4(tiny_nvfp4):
    source = open_weights(tiny_nvfp4, activations="w4a16")
    lin = source.layer(2, "cpu").mlp.experts[5].up_proj
    assert isinstance(lin, NVFP4Linear) and lin.mode is ActivationMode.W4A16
    assert torch.equal(lin.weight(), dequantize_nvfp4(lin.tensor))
    x = torch.randn(4, lin.in_features, generator=GEN)
    assert torch.equal(lin(x), F.linear(x, lin.weight()))  # activations untouched


def test_w4a4_without_input_scale_is_a_clear_error(tiny_nvfp4):
    with pytest.raises(CheckpointError, match="has no input_scale, which W4A4 emulation needs") as e:
        open_weights(tiny_nvfp4).layer(1, "cpu")
    assert "mlp.experts.0.gate_proj.input_scale" in str(e.value)


def test_w4a4_layer_max_input_scale_as_sglang_flashinfer(tiny_nvfp4_calibrated):
    source = open_weights(tiny_nvfp4_calibrated)  # default: w4a4, layer_max
    experts = source.layer(1, "cpu").mlp.experts
    n = len(experts)
    # fixture scales: 0.001 * (1 + e + {gate 0, up 0.5, down 0.25}); max over the layer's experts
    w13 = torch.tensor(0.001 * (n + 0.5))
    w2 = torch.tensor(0.001 * (n + 0.25))
    for e in experts:
        assert torch.allclose(e.gate_proj.input_scale, w13) and torch.allclose(e.up_proj.input_scale, w13)
        assert torch.allclose(e.down_proj.input_scale, w2)
    lin = experts[2].gate_proj
    x = torch.randn(5, lin.in_features, generator=GEN)
    expected = F.linear(fake_quantize_activation_nvfp4(x, lin.input_scale), dequantize_nvfp4(lin.tensor))
    assert torch.equal(lin(x), expected)
    assert not torch.equal(lin(x), F.linear(x, lin.weight()))  # activations really were quantized


def test_w4a4_per_expert_reduction(tiny_nvfp4_calibrated):
    source = NVFP4Weights(tiny_nvfp4_calibrated, input_scale_reduction="per_expert")
    e3 = source.layer(2, "cpu").mlp.experts[3]
    assert torch.allclose(e3.gate_proj.input_scale, torch.tensor(0.0045))  # max(gate 0.004, up 0.0045)
    assert torch.allclose(e3.up_proj.input_scale, torch.tensor(0.0045))
    assert torch.allclose(e3.down_proj.input_scale, torch.tensor(0.00425))


def test_input_scales_override_the_checkpoint(tiny_nvfp4):
    scales = {
        f"language_model.model.layers.1.mlp.experts.{e}.{p}.input_scale": 0.01 * (e + 1)
        for e in range(8) for p in ("gate_proj", "up_proj", "down_proj")
    }
    scales["model.layers.1.mlp.experts.0.down_proj"] = 0.5  # module name, no prefix: also accepted
    layer = NVFP4Weights(tiny_nvfp4, input_scales=scales).layer(1, "cpu")
    assert torch.allclose(layer.mlp.experts[0].gate_proj.input_scale, torch.tensor(0.08))
    assert torch.allclose(layer.mlp.experts[0].down_proj.input_scale, torch.tensor(0.5))
    with pytest.raises(CheckpointError, match="input_scale"):
        NVFP4Weights(tiny_nvfp4, input_scales=scales).layer(2, "cpu")  # layer 2 still has none


def test_up_uses_gates_weight_scale_2(tiny_nvfp4, copy_checkpoint):
    """SGLang keeps w13_weight_scale_2[:, 0] (gate's) for both halves of the fused w13 GEMM."""
    from safetensors.torch import load_file, save_file

    ckpt = copy_checkpoint(tiny_nvfp4)
    shard = next(ckpt.glob("*.safetensors"))
    tensors = load_file(str(shard))
    name = "language_model.model.layers.1.mlp.experts.4.up_proj.weight_scale_2"
    gate_scale = tensors[name.replace("up_proj", "gate_proj")].clone()
    tensors[name] = gate_scale * 2
    save_file(tensors, str(shard))
    up = open_weights(ckpt, activations="w4a16").layer(1, "cpu").mlp.experts[4].up_proj
    assert torch.equal(up.tensor.weight_scale_2, gate_scale)


def test_nvfp4_model_tracks_int4_model(tiny_src, tiny_nvfp4, tiny_nvfp4_calibrated):
    """The NVFP4 conversion changes the logits a little, W4A4 a little more; never wildly."""
    seqs = [torch.randint(0, 512, (24,), generator=GEN)]
    ref = next(LayerStreamRunner(open_weights(tiny_src), progress=False).run(seqs))
    w4a16 = next(LayerStreamRunner(open_weights(tiny_nvfp4, activations="w4a16"), progress=False).run(seqs))
    w4a4 = next(LayerStreamRunner(open_weights(tiny_nvfp4_calibrated), progress=False).run(seqs))

    def rel(a):
        return float((a - ref).norm() / ref.norm())

    assert 0 < rel(w4a16) < 0.1
    assert 0 < rel(w4a4) < 0.2
    assert not torch.equal(w4a4, w4a16)


def test_fused_dense_nvfp4_linears_take_the_max_scales(tiny_src, tmp_path):
    """SGLang's ModelOptFp4LinearMethod: a fused gate_up_proj / fused_qkv_a_proj_with_mqa takes
    input_scale.max() and weight_scale_2.max() over its parts, without requantizing."""
    from .conftest import nvfp4_from_int4

    scales = {"mlp.shared_experts.gate_proj": 0.01, "mlp.shared_experts.up_proj": 0.03, "self_attn.q_a_proj": 0.02,
              "self_attn.kv_a_proj_with_mqa": 0.05, "self_attn.o_proj": 0.07}

    def dense(module):
        if ".layers.1." not in module:
            return None
        return next((v for k, v in scales.items() if module.endswith(k)), None)

    ckpt = nvfp4_from_int4(tiny_src, tmp_path / "dense_nvfp4", input_scales=lambda m: 0.004, dense_nvfp4=dense)
    source = open_weights(ckpt)
    layer = source.layer(1, "cpu")
    gate, up = layer.mlp.shared_experts.gate_proj, layer.mlp.shared_experts.up_proj
    assert isinstance(gate, NVFP4Linear) and isinstance(layer.mlp.shared_experts.down_proj, DenseLinear)
    file_scale_2 = [source.reader.load(f"language_model.model.layers.1.{m}.weight_scale_2") for m in (gate.module, up.module)]
    assert file_scale_2[0] != file_scale_2[1]
    assert torch.equal(gate.tensor.weight_scale_2, max(file_scale_2)) and torch.equal(up.tensor.weight_scale_2, max(file_scale_2))
    assert torch.allclose(gate.input_scale, torch.tensor(0.03)) and torch.allclose(up.input_scale, torch.tensor(0.03))
    q_a, kv_a = layer.self_attn.q_a_proj, layer.self_attn.kv_a_proj_with_mqa
    assert torch.allclose(q_a.input_scale, torch.tensor(0.05)) and torch.allclose(kv_a.input_scale, torch.tensor(0.05))
    assert torch.allclose(layer.self_attn.o_proj.input_scale, torch.tensor(0.07))  # alone: its own
    assert isinstance(source.layer(2, "cpu").mlp.shared_experts.gate_proj, DenseLinear)
    logits = next(LayerStreamRunner(source, progress=False).run([torch.arange(10)]))
    assert torch.isfinite(logits).all()


def test_observer_sees_the_unquantized_input_in_w4a4(tiny_nvfp4_calibrated):
    """Calibration measures the activation BEFORE the kernel quantizes it; y is what the kernel returns."""
    from kimi_nvfp4.model import NullObserver

    source = open_weights(tiny_nvfp4_calibrated)
    layer = source.layer(1, "cpu")
    seen = []

    class Keep(NullObserver):
        def on_linear(self, layer_index, module, x, y, expert=None, routed=True):
            if layer_index == 1 and expert is not None and module.endswith("down_proj") and not seen:
                seen.append((expert, x.clone(), y.clone()))

    list(LayerStreamRunner(source, progress=False).run([torch.arange(40) % 512], observer=Keep()))
    expert, x, y = seen[0]
    lin = layer.mlp.experts[expert].down_proj
    assert not torch.equal(x, fake_quantize_activation_nvfp4(x, lin.input_scale))  # x is raw
    assert torch.allclose(y, lin(x), rtol=1e-5, atol=1e-6)


def test_malformed_int4_scale_is_a_checkpoint_error(tiny_src, copy_checkpoint):
    from safetensors.torch import load_file, save_file

    ckpt = copy_checkpoint(tiny_src)
    name = "language_model.model.layers.2.mlp.experts.6.up_proj.weight_scale"
    shard = ckpt / json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"][name]
    tensors = load_file(str(shard))
    tensors[name] = tensors[name][:, :1].contiguous()
    save_file(tensors, str(shard))
    source = open_weights(ckpt)
    source.layer(1, "cpu")  # other layers still load
    with pytest.raises(CheckpointError, match=r"shape \(32, 1\) does not match the config's \(32, 2\)") as e:
        source.layer(2, "cpu")
    assert f"tensor {name}" in str(e.value) and shard.name in str(e.value)
