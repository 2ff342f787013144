"""INT4 pack-quantized export: bit-exact with compressed-tensors, packed per SPEC §1."""

from __future__ import annotations

import pytest
import torch

from kimi_nvfp4.demo_model.int4_export import fake_quantize_int4, quantize_int4_codes, quantize_int4_packed
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
    codes, scale = quantize_int4_codes(w)
    assert scale.dtype == torch.bfloat16 and torch.equal(scale, ct_scale)
    assert torch.equal(codes, ct_codes)


def test_extreme_codes_and_zero_group():
    codes, scale = quantize_int4_codes(_weight())
    assert int(codes.min()) == -8 or int(codes.max()) == 7
    assert codes.min() >= -8 and codes.max() <= 7
    assert torch.all(codes[1, :32] == 0) and float(scale[1, 0]) == torch.finfo(torch.bfloat16).eps


def test_packed_layout_round_trips_to_the_fake_quantized_values():
    w = _weight()
    packed = quantize_int4_packed(w)
    assert packed.weight_packed.dtype == torch.int32 and tuple(packed.weight_packed.shape) == (48, 96 // 8)
    assert packed.weight_scale.dtype == torch.bfloat16 and tuple(packed.weight_scale.shape) == (48, 96 // 32)
    assert packed.weight_shape.dtype == torch.int32 and packed.weight_shape.tolist() == [48, 96]
    codes, _ = quantize_int4_codes(w)
    assert torch.equal(unpack_int4(packed.weight_packed, 96), codes)
    assert torch.equal(packed.dequantize(), fake_quantize_int4(w))
    # column 8j+k sits in bits 4k..4k+3 of word j as q + 8 (SPEC §1)
    word = int(packed.weight_packed[2, 5]) & 0xFFFFFFFF
    assert [(word >> (4 * k)) & 0xF for k in range(8)] == [int(c) + 8 for c in codes[2, 40:48]]


def test_quantization_error_is_about_half_a_step_at_most():
    w = _weight().to(torch.bfloat16).float()
    _, scale = quantize_int4_codes(w)
    err = (fake_quantize_int4(w) - w).abs()
    step = scale.float().repeat_interleave(32, dim=1)
    # Half a step, plus what bf16 rounding of the scale and of w / scale can add (2^-8 relative each,
    # at |w / scale| <= 7.5: under 0.06 of a step).
    assert torch.all(err <= step * 0.56)
    assert float((err / step).mean()) < 0.3


def test_input_width_not_a_multiple_of_the_group_is_refused():
    with pytest.raises(ValueError, match="divisible by 32"):
        quantize_int4_codes(torch.zeros(4, 40))
