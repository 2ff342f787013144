"""The one INT4 quantizer (synth, the demo export, the tests): bit-exact with compressed-tensors on bf16 weights,
packed per SPEC §1, the same in place or not."""

from __future__ import annotations

import pytest
import torch

from kimi_nvfp4.checkpoint_builder.int4 import fake_quantize_int4, quantize_int4, quantize_int4_packed
from kimi_nvfp4.numerics.int4 import unpack_int4


def _weight(out_features=48, in_features=96, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_features, in_features, generator=g) * 0.05
    w[1, :32] = 0.0  # an all-zero group
    w[2, 32:64] = torch.linspace(-1, 1, 32)  # hits -8 and +7 after rounding
    return w


def test_codes_and_scales_match_compressed_tensors_bit_for_bit():
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32)
    w = _weight().to(torch.bfloat16)
    groups = w.reshape(w.shape[0], -1, 32)
    ct_scale, ct_zero = calculate_qparams(groups.amin(-1), groups.amax(-1), args)
    ct_codes = quantize(w, ct_scale, ct_zero, args, dtype=torch.int8)
    codes, scale = quantize_int4(w)
    assert scale.dtype == torch.bfloat16 and torch.equal(scale, ct_scale)
    assert torch.equal(codes, ct_codes)


def test_extreme_codes_and_zero_group():
    codes, scale = quantize_int4(_weight())
    assert int(codes.min()) == -8 or int(codes.max()) == 7
    assert codes.min() >= -8 and codes.max() <= 7
    assert torch.all(codes[1, :32] == 0) and float(scale[1, 0]) == torch.finfo(torch.bfloat16).eps


def test_packed_layout_round_trips_to_the_fake_quantized_values():
    w = _weight()
    packed = quantize_int4_packed(w)
    assert packed.weight_packed.dtype == torch.int32 and tuple(packed.weight_packed.shape) == (48, 96 // 8)
    assert packed.weight_scale.dtype == torch.bfloat16 and tuple(packed.weight_scale.shape) == (48, 96 // 32)
    assert packed.weight_shape.dtype == torch.int32 and packed.weight_shape.tolist() == [48, 96]
    codes, _ = quantize_int4(w.to(torch.bfloat16))
    assert torch.equal(unpack_int4(packed.weight_packed, 96), codes)
    assert torch.equal(packed.dequantize(), fake_quantize_int4(w))
    # column 8j+k sits in bits 4k..4k+3 of word j as q + 8 (SPEC §1)
    word = int(packed.weight_packed[2, 5]) & 0xFFFFFFFF
    assert [(word >> (4 * k)) & 0xF for k in range(8)] == [int(c) + 8 for c in codes[2, 40:48]]


def test_quantization_error_is_about_half_a_step_at_most():
    w = _weight().to(torch.bfloat16).float()
    _, scale = quantize_int4(w)
    err = (fake_quantize_int4(w) - w).abs()
    step = scale.float().repeat_interleave(32, dim=1)
    # Half a step, plus what bf16 rounding of the scale and of w / scale can add (2^-8 relative each,
    # at |w / scale| <= 7.5: under 0.06 of a step).
    assert torch.all(err <= step * 0.56)
    assert float((err / step).mean()) < 0.3


def test_input_width_not_a_multiple_of_the_group_is_refused():
    with pytest.raises(ValueError, match="divisible by 32"):
        quantize_int4(torch.zeros(4, 40))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_in_place_gives_the_same_codes_and_scales(dtype):
    w = _weight(out_features=64, in_features=256, seed=3).to(dtype)
    expected = quantize_int4(w)
    scratch = w.clone()
    got = quantize_int4(scratch, in_place=True)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    assert not torch.equal(scratch, w)  # the scratch weight was used


def test_float32_weights_divide_by_the_stored_bf16_scale():
    """The float32 rule (synth, tests): absmax / 7.5 rounded to bf16, then w / that scale in float32."""
    w = _weight(out_features=32, in_features=128, seed=4)
    groups = w.reshape(32, -1, 32)
    scale = (groups.abs().amax(-1) / 7.5).to(torch.bfloat16)
    scale = torch.where(scale == 0, torch.finfo(torch.bfloat16).eps, scale.float()).to(torch.bfloat16)
    codes = torch.clamp(torch.round(groups / scale.float().unsqueeze(-1)), -8, 7).to(torch.int8).reshape(32, 128)
    got_codes, got_scale = quantize_int4(w)
    assert torch.equal(got_codes, codes) and torch.equal(got_scale, scale)
