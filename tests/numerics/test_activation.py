"""fake_quantize_activation_nvfp4: golden vectors worked by hand from the kernel recipe
(SFValue = (1/input_scale) * amax/6 -> e4m3; x * 1/(SF * input_scale) -> E2M1 RN; back: e2m1 * SF * input_scale)."""

from __future__ import annotations

import pytest
import torch

from kimi_nvfp4.numerics.nvfp4 import fake_quantize_activation_nvfp4


def _block(*values: float) -> torch.Tensor:
    return torch.tensor(list(values) + [0.0] * (16 - len(values)))


def test_representable_block_is_exact():
    # input_scale 0.5 -> SFScaleVal 2; amax 6 -> SF = 2 (exact e4m3); outputScale = 1.
    x = _block(6, -3, 1, 0.5, -1.5, 4, 2)
    assert torch.equal(fake_quantize_activation_nvfp4(x, 0.5), x)


def test_rounded_block_scale_and_saturation():
    # amax 7: SF = 2 * 7/6 = 2.333 -> e4m3 2.25; step = 2.25 * 0.5 = 1.125.
    # 7/1.125 = 6.22 -> 6 (saturate) -> 6.75; 1/1.125 = 0.889 -> 1 -> 1.125; 3/1.125 = 2.67 -> 3 -> 3.375;
    # -0.3/1.125 = -0.267 -> -0.5 -> -0.5625; 0.2/1.125 = 0.178 -> 0.
    x = _block(7, 1, 3, -0.3, 0.2)
    expected = _block(6.75, 1.125, 3.375, -0.5625, 0.0)
    assert torch.equal(fake_quantize_activation_nvfp4(x, 0.5), expected)


def test_values_beyond_calibrated_amax_clip_at_it():
    # input_scale = amax_cal / 2688 with amax_cal = 2.688: a block with amax 6 wants SF 1000 -> saturates at 448,
    # so the largest representable value is 6 * 448 * input_scale = amax_cal.
    input_scale = 0.001
    x = _block(6, -6, 1)
    out = fake_quantize_activation_nvfp4(x, input_scale)
    assert float(out[0]) == pytest.approx(6 * 448 * input_scale, rel=1e-6)
    assert float(out[1]) == pytest.approx(-6 * 448 * input_scale, rel=1e-6)
    # 1 * 1/(448*0.001) = 2.23 -> 2 -> 2 * 0.448
    assert float(out[2]) == pytest.approx(2 * 448 * input_scale, rel=1e-6)


def test_zero_block_stays_zero_and_blocks_are_independent():
    x = torch.cat([torch.zeros(16), _block(6, 1)]).reshape(1, 32)
    out = fake_quantize_activation_nvfp4(x, 0.5)
    assert torch.equal(out[0, :16], torch.zeros(16))
    assert torch.equal(out[0, 16:], _block(6, 1))


def test_shape_dtype_and_idempotence():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 64, generator=gen).to(torch.bfloat16)
    input_scale = torch.tensor(float(x.float().abs().amax()) / 2688)
    out = fake_quantize_activation_nvfp4(x, input_scale)
    assert out.shape == x.shape and out.dtype == torch.float32
    # relative error of NVFP4 on Gaussian data is a few percent, not more
    rel = float((out - x.float()).square().sum() / x.float().square().sum())
    assert 1e-4 < rel < 0.03
    again = fake_quantize_activation_nvfp4(out, input_scale)
    assert torch.equal(again, out)


def test_rejects_width_not_multiple_of_16():
    with pytest.raises(ValueError):
        fake_quantize_activation_nvfp4(torch.zeros(2, 24), 1.0)
