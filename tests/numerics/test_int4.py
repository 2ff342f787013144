"""kimi_nvfp4.numerics.int4 against compressed-tensors' own packer (the format's reference)."""

from __future__ import annotations

import pytest
import torch
from compressed_tensors.compressors.pack_quantized.helpers import (
    pack_to_int32,
    unpack_from_int32,
)

from kimi_nvfp4.numerics.int4 import (
    dequantize_int4,
    group_scales_fp32,
    pack_int4,
    unpack_int4,
)


@pytest.mark.parametrize("shape", [(3, 32), (5, 40), (1, 8), (7, 9), (2, 1)], ids=str)
def test_pack_matches_compressed_tensors(shape):
    gen = torch.Generator().manual_seed(shape[0] * 100 + shape[1])
    codes = torch.randint(-8, 8, shape, generator=gen, dtype=torch.int8)
    ours = pack_int4(codes)
    theirs = pack_to_int32(codes, 4)
    assert torch.equal(ours, theirs)
    assert torch.equal(unpack_int4(theirs, shape[1]), codes)
    assert torch.equal(unpack_from_int32(ours, 4, torch.Size(shape)), codes)


def test_full_range_every_nibble_position():
    # Every code -8..7 at every position k of a word (bits 4k..4k+3).
    codes = torch.arange(-8, 8, dtype=torch.int8).repeat(8, 1)
    codes = torch.stack([torch.roll(codes[0], k) for k in range(8)]).reshape(8, 16)
    assert torch.equal(pack_int4(codes), pack_to_int32(codes, 4))
    assert torch.equal(unpack_int4(pack_int4(codes), 16), codes)


def test_bit_layout_golden():
    # column 8j+k is bits 4k..4k+3 of word j; nibble = q + 8.
    codes = torch.tensor([[-8, -7, 0, 7, 1, -1, 2, 3]], dtype=torch.int8)
    nibbles = [0, 1, 8, 15, 9, 7, 10, 11]
    word = sum(n << (4 * k) for k, n in enumerate(nibbles))
    word = word - (1 << 32) if word >= 1 << 31 else word
    assert pack_int4(codes).tolist() == [[word]]


def test_dequantize_is_exact_code_times_group_scale():
    codes = torch.randint(-8, 8, (4, 64), generator=torch.Generator().manual_seed(3), dtype=torch.int8)
    scale = torch.rand(4, 2, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    values = dequantize_int4(pack_int4(codes), scale, 64)
    expected = codes.double() * scale.double().repeat_interleave(32, dim=1)
    assert torch.equal(values.double(), expected)
    assert torch.equal(group_scales_fp32(scale, 64)[:, 31], scale[:, 0].float())


def test_rejects_bad_input():
    with pytest.raises(ValueError):
        unpack_int4(torch.zeros(2, 2, dtype=torch.int64), 16)
    with pytest.raises(ValueError):
        unpack_int4(torch.zeros(2, 2, dtype=torch.int32), 40)
    with pytest.raises(ValueError):
        pack_int4(torch.full((1, 8), 8, dtype=torch.int8))


def test_byte_wise_unpack_equals_unpack_int4_for_every_nibble_pattern():
    from kimi_nvfp4.numerics.methods.int4_matrix import unpack_int4_bytes

    gen = torch.Generator().manual_seed(3)
    words = torch.randint(-(2**31), 2**31 - 1, (33, 16), dtype=torch.int32, generator=gen)
    words[0] = torch.tensor([-1, 0, 2**31 - 1, -(2**31)] * 4, dtype=torch.int32)  # all-ones, zero, sign bit
    got = unpack_int4_bytes(words, 128)
    assert got.dtype == torch.int8 and torch.equal(got, unpack_int4(words, 128))
    # Widths that are not whole words fall back to (and validate like) unpack_int4.
    assert torch.equal(unpack_int4_bytes(words, 127), unpack_int4(words, 127))
    with pytest.raises(ValueError):
        unpack_int4_bytes(words, 200)


def _reference_pack(codes: torch.Tensor) -> torch.Tensor:
    """The arithmetic packer pack_int4 used before its byte-wise rewrite (int64 nibbles << 4k, summed)."""
    out_features, in_features = codes.shape
    pad = (-in_features) % 8
    nibbles = codes.to(torch.int64) + 8
    if pad:
        nibbles = torch.nn.functional.pad(nibbles, (0, pad), value=0)
    words = (nibbles.reshape(out_features, -1, 8) << (torch.arange(8, dtype=torch.int64) * 4)).sum(dim=-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


@pytest.mark.parametrize("shape", [(7, 7168), (16, 2048), (3, 33), (4, 15), (1, 2), (9, 1)], ids=str)
def test_byte_wise_pack_equals_the_arithmetic_pack_and_compressed_tensors(shape):
    gen = torch.Generator().manual_seed(sum(shape))
    codes = torch.randint(-8, 8, shape, generator=gen, dtype=torch.int8)
    codes[0, : min(16, shape[1])] = torch.arange(-8, 8, dtype=torch.int8)[: min(16, shape[1])]
    ours = pack_int4(codes)
    assert ours.dtype == torch.int32 and ours.is_contiguous()
    assert torch.equal(ours, _reference_pack(codes))
    assert torch.equal(ours, pack_to_int32(codes, 4))
    assert torch.equal(unpack_int4(ours, shape[1]), codes)


def test_pack_accepts_other_integer_dtypes_and_strided_codes():
    """compressed-tensors' `pack_to_int32` is the oracle (its int8 form, contiguous: the case it was written for)."""
    codes = torch.randint(-8, 8, (24, 40), generator=torch.Generator().manual_seed(9), dtype=torch.int8)
    expected = pack_to_int32(codes, 4)
    for variant in (codes.to(torch.int32), codes.to(torch.int64), codes.to(torch.int16)):
        assert torch.equal(pack_int4(variant), expected)
    transposed = codes.t().contiguous().t()  # same values, column-major storage
    assert not transposed.is_contiguous() and torch.equal(pack_int4(transposed), expected)
    view = codes[:, :33]  # a strided view whose rows need padding
    assert not view.is_contiguous() and torch.equal(pack_int4(view), pack_to_int32(view.contiguous(), 4))
    assert pack_int4(torch.zeros(0, 16, dtype=torch.int8)).shape == (0, 2)
    assert pack_int4(torch.zeros(3, 0, dtype=torch.int8)).shape == (3, 0)
    with pytest.raises(ValueError):
        pack_int4(torch.full((1, 8), -9, dtype=torch.int8))
    with pytest.raises(ValueError):
        pack_int4(torch.zeros(8, dtype=torch.int8))


@pytest.mark.gpu
def test_pack_on_cuda_equals_cpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    codes = torch.randint(-8, 8, (64, 7168 + 4), generator=torch.Generator().manual_seed(2), dtype=torch.int8)
    got = pack_int4(codes.cuda())
    assert got.device.type == "cuda" and torch.equal(got.cpu(), pack_int4(codes))
