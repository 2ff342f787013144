"""E2M1 golden vectors: every code, every rounding midpoint, signed zero, saturation, nibble order."""

from __future__ import annotations

import pytest
import torch

from kimi_nvfp4.numerics.e2m1 import (
    E2M1_VALUES,
    decode_e2m1,
    encode_e2m1,
    pack_e2m1,
    unpack_e2m1,
)

MAGNITUDES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def test_all_sixteen_codes_decode_to_the_table():
    codes = torch.arange(16, dtype=torch.uint8)
    expected = torch.tensor(MAGNITUDES + [-m for m in MAGNITUDES])
    assert torch.equal(decode_e2m1(codes), expected)
    assert torch.equal(E2M1_VALUES, expected)


def test_every_representable_value_encodes_to_its_code():
    values = torch.tensor(MAGNITUDES[1:] + [-m for m in MAGNITUDES[1:]])
    expected = torch.tensor(list(range(1, 8)) + list(range(9, 16)), dtype=torch.uint8)
    assert torch.equal(encode_e2m1(values), expected)


@pytest.mark.parametrize(
    "midpoint, rounds_to",
    [(0.25, 0.0), (0.75, 1.0), (1.25, 1.0), (1.75, 2.0), (2.5, 2.0), (3.5, 4.0), (5.0, 4.0)],
    ids=lambda v: str(v),
)
def test_midpoints_round_to_even_mantissa(midpoint, rounds_to):
    x = torch.tensor([midpoint, -midpoint])
    assert torch.equal(decode_e2m1(encode_e2m1(x)), torch.tensor([rounds_to, -rounds_to]))
    # Just off the midpoint, rounding goes to the nearer neighbour.
    below = torch.nextafter(torch.tensor(midpoint), torch.tensor(0.0))
    above = torch.nextafter(torch.tensor(midpoint), torch.tensor(10.0))
    lower = max(m for m in MAGNITUDES if m < midpoint)
    upper = min(m for m in MAGNITUDES if m > midpoint)
    assert float(decode_e2m1(encode_e2m1(below.reshape(1)))) == lower
    assert float(decode_e2m1(encode_e2m1(above.reshape(1)))) == upper


def test_signed_zero_and_tiny_negatives_follow_model_optimizer():
    x = torch.tensor([0.0, -0.0, -0.1, 0.1, -0.25])
    # ModelOpt's sign bit is `x < 0`: -0.0 -> +0 (code 0); small negatives -> -0 (code 8).
    assert encode_e2m1(x).tolist() == [0, 0, 8, 0, 8]


def test_saturation_at_six():
    x = torch.tensor([5.0001, 6.0, 7.0, 1e30, float("inf"), -8.0, -float("inf")])
    assert encode_e2m1(x).tolist() == [7, 7, 7, 7, 7, 15, 15]


def test_pack_puts_even_column_in_low_nibble():
    codes = torch.tensor([[0x1, 0xA, 0xF, 0x0]], dtype=torch.uint8)
    packed = pack_e2m1(codes)
    assert packed.tolist() == [[0xA1, 0x0F]]
    assert torch.equal(unpack_e2m1(packed), codes)


def test_pack_round_trips_all_pairs():
    a, b = torch.meshgrid(torch.arange(16), torch.arange(16), indexing="ij")
    codes = torch.stack([a.flatten(), b.flatten()], dim=-1).to(torch.uint8)
    assert torch.equal(unpack_e2m1(pack_e2m1(codes)), codes)
    # pair (low, high) packs to high << 4 | low
    assert pack_e2m1(codes).flatten().tolist() == [(h << 4) | l for l in range(16) for h in range(16)]


def test_matches_model_optimizer_cast_on_random_values():
    from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4096, generator=gen) * 3
    grid = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.0, -0.0, 6.0, 7.0])
    x = torch.cat([x, grid, -grid])
    assert torch.equal(encode_e2m1(x), NVFP4QTensor._cast_fp4(x.clone()))


def test_rejects_wrong_dtypes():
    with pytest.raises(ValueError):
        encode_e2m1(torch.zeros(2, dtype=torch.float16))
    with pytest.raises(ValueError):
        pack_e2m1(torch.zeros(3, dtype=torch.uint8))


def test_round_e2m1_magnitude_matches_encode_decode():
    from kimi_nvfp4.numerics.e2m1 import round_e2m1_magnitude

    gen = torch.Generator().manual_seed(1)
    bounds = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0])
    # every fp32 within 300 ulps of each bound / grid point, plus random values over 40 binades
    ulps = torch.arange(-300, 301, dtype=torch.int32)
    near = (bounds.view(torch.int32).unsqueeze(-1) + ulps).view(torch.float32).flatten()
    x = torch.cat([
        near,
        torch.rand(20000, generator=gen) * 8,
        torch.exp2(torch.rand(20000, generator=gen) * 40 - 30),
        torch.tensor([0.0, 1e-45, 1e-40, 1e30, 3.4e38]),
    ])
    assert torch.equal(round_e2m1_magnitude(x), decode_e2m1(encode_e2m1(x)))


def test_matches_model_optimizer_at_every_bound_and_its_fp32_neighbours():
    from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor

    bounds = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.5, 1.0, 6.0])
    near = torch.cat([bounds, torch.nextafter(bounds, torch.zeros_like(bounds)), torch.nextafter(bounds, bounds * 2)])
    near = torch.cat([near, -near])
    assert torch.equal(encode_e2m1(near), NVFP4QTensor._cast_fp4(near.clone()))


def test_magnitude_histogram_counts_absolute_codes():
    from kimi_nvfp4.numerics.methods.search.reference import magnitude_histogram

    codes = torch.tensor([[-8, 7, -7, 0, 1, 1, -1, 2, 3, 4, 5, 6, -6, 0, 0, 0]], dtype=torch.int8)
    assert magnitude_histogram(codes).flatten().tolist() == [3.0, 1.0, 1.0, 1.0, 1.0, 2.0, 2.0, 1.0]


def test_comparison_encode_matches_model_optimizer_and_searchsorted_on_hard_inputs():
    """The comparison-count encoder equals `_cast_fp4` and the searchsorted form on every hard input:
    300 ulps around every bound and grid point, both signs, zeros, subnormals, huge values, inf, NaN."""
    from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor

    from kimi_nvfp4.numerics.e2m1 import _decision_bounds

    gen = torch.Generator().manual_seed(2)
    points = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0])
    ulps = torch.arange(-300, 301, dtype=torch.int32)
    near = (points.view(torch.int32).unsqueeze(-1) + ulps).view(torch.float32).flatten()
    special = torch.tensor([0.0, -0.0, 1e-45, -1e-45, 1e-40, 3.4e38, float("inf"), -float("inf")])
    x = torch.cat([near, -near, special, torch.randn(50000, generator=gen) * 4])
    assert torch.equal(encode_e2m1(x), NVFP4QTensor._cast_fp4(x.clone()))
    magnitude = torch.searchsorted(_decision_bounds(), x.abs(), out_int32=True).to(torch.uint8)
    assert torch.equal(encode_e2m1(x), ((x < 0).to(torch.uint8) << 3) | magnitude)
    nan = torch.tensor([float("nan"), -float("nan")])
    reference = torch.searchsorted(_decision_bounds(), nan.abs(), out_int32=True).to(torch.uint8)
    assert torch.equal(encode_e2m1(nan), reference)  # NaN counts as above every bound, as in searchsorted


def test_decode_keeps_shape_and_ignores_high_bits():
    codes = torch.arange(32, dtype=torch.uint8).reshape(2, 4, 4)
    assert torch.equal(decode_e2m1(codes), E2M1_VALUES[(codes & 0xF).long()])
    assert decode_e2m1(torch.empty(0, 3, dtype=torch.uint8)).shape == (0, 3)
