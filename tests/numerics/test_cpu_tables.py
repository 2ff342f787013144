"""The CPU's byte-lookup paths (`search/cpu_tables.py`, `search/cpu_search.py`, `search/scale_table.py`, the stats
and dequantize lookups) against the elementwise reference they replace: every result must be bit-identical."""

from __future__ import annotations

import pytest
import torch

import kimi_nvfp4.numerics.methods.search.cpu_search as cpu_search_module
import kimi_nvfp4.numerics.methods.stats as stats_module
from kimi_nvfp4.numerics.e2m1 import (
    decode_e2m1,
    decode_e2m1_packed,
    pack_e2m1,
    unpack_e2m1,
)
from kimi_nvfp4.numerics.int4 import pack_int4
from kimi_nvfp4.numerics.methods import Int4Matrix, ScaleMethod, SearchPath, quantize_int4_matrices
from kimi_nvfp4.numerics.methods.catalog.int4_aware import INT4_AWARE_RULE
from kimi_nvfp4.numerics.methods.search.cpu_search import KeyTable, key_bits
from kimi_nvfp4.numerics.methods.search.cpu_tables import (
    BlockKeys,
    code_bytes,
    cpu_tables_apply,
    encode_blocks,
    group_code_squares,
    scale_ids,
)
from kimi_nvfp4.numerics.methods.search.reference import (
    block_max_code,
    candidate_errors,
    error_total_rows,
    flat_blocks,
    magnitude_histogram,
    model_optimizer_block_bits,
    search_reference,
)
from kimi_nvfp4.numerics.methods.search.rule import EveryE4M3Scale, power_of_two_tensor_scale
from kimi_nvfp4.numerics.methods.search.scale_table import ScaleTable, search_by_scale_table
from kimi_nvfp4.numerics.methods.stats import error_sums
from kimi_nvfp4.numerics.nvfp4 import (
    NVFP4Tensor,
    dequantize_nvfp4,
    encode_with_block_scales,
    quantize_nvfp4,
    tensor_scale_from_amax,
)

from .conftest import realistic_int4

_TINY, _HUGE, _OVERFLOWING = 2.0**-20, 3.0e4, 1.0e30


def _bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).to(torch.float32)


def edge_matrix(seed: int, rows: int = 48, cols: int = 512, scales: str = "bf16") -> Int4Matrix:
    """Realistic codes plus zero groups and blocks, saturated rows, every code, tiny/huge/zero/negative scales."""
    m = realistic_int4(rows, cols, seed=seed, row_spread=1.5)
    codes, scale = m.codes.clone(), m.group_scale.clone()
    codes[0, :32] = 0
    codes[1, 16:32] = 0
    codes[2] = 7
    codes[3] = -8
    codes[4] = torch.arange(cols) % 16 - 8
    codes[5:9] = torch.randint(-8, 8, (4, cols), generator=torch.Generator().manual_seed(seed), dtype=torch.int8)
    scale[5] = _TINY
    scale[6] = _HUGE
    scale[7, ::2] = 0.0
    scale[8] = -scale[8]
    if scales == "fp32":  # not bf16: the torch.unique fallback of scale_ids
        scale = scale * (1 + 2.0**-20)
    elif scales == "overflowing":  # squared errors overflow fp32: the search keeps the reference path
        scale[9] = _OVERFLOWING
    return Int4Matrix(codes, _bf16(scale) if scales == "bf16" else scale)


MATRICES = {
    "realistic": lambda: realistic_int4(64, 1024, seed=3),
    "edge": lambda: edge_matrix(1),
    "fp32-scales": lambda: edge_matrix(2, scales="fp32"),
    "overflowing": lambda: edge_matrix(4, scales="overflowing"),
    "uniform-codes": lambda: Int4Matrix(
        torch.randint(-8, 8, (32, 2048), generator=torch.Generator().manual_seed(5), dtype=torch.int8),
        _bf16(torch.rand(32, 64, generator=torch.Generator().manual_seed(6)) * 1e-2 + 1e-3),
    ),
}


@pytest.fixture(params=sorted(MATRICES))
def matrix(request) -> Int4Matrix:
    return MATRICES[request.param]()


@pytest.fixture
def small_steps(monkeypatch):
    """Many partial steps in every stepped loop."""
    import kimi_nvfp4.numerics.methods.search.cpu_tables as cpu_tables_module

    monkeypatch.setattr(cpu_search_module, "_BLOCKS_PER_STEP", 100)
    monkeypatch.setattr(cpu_tables_module, "_ENCODE_STEP_BYTES", 1000)
    monkeypatch.setattr(stats_module, "_CPU_DIFF_STEP_ELEMENTS", 3000)
    monkeypatch.setattr(stats_module, "_STATS_STEP_ELEMENTS", {"cpu": 20000})


def _same_tensors(ours: NVFP4Tensor, theirs: NVFP4Tensor) -> None:
    assert torch.equal(ours.weight, theirs.weight)
    assert torch.equal(ours.weight_scale.view(torch.uint8), theirs.weight_scale.view(torch.uint8))
    assert torch.equal(ours.weight_scale_2, theirs.weight_scale_2)


def test_code_bytes_are_the_packed_words_bytes(matrix):
    words = pack_int4(matrix.codes)
    assert torch.equal(code_bytes(matrix), words.view(torch.uint8))
    read = Int4Matrix.from_packed(words, matrix.group_scale, matrix.shape[1])
    assert torch.equal(read.packed_bytes, code_bytes(matrix))
    assert torch.equal(matrix.rows(3, 9).packed_bytes, code_bytes(matrix)[3:9])


def test_out_of_range_codes_and_bad_scales_keep_the_reference_path():
    m = realistic_int4(4, 64)
    assert cpu_tables_apply(m)
    assert not cpu_tables_apply(Int4Matrix(m.codes * 2, m.group_scale))  # codes beyond [-8, 7]: no nibble holds them
    for bad in (float("nan"), float("inf")):
        scale = m.group_scale.clone()
        scale[0, 0] = bad
        assert not cpu_tables_apply(Int4Matrix(m.codes, scale))


def test_scale_ids_map_back_to_the_exact_scales(matrix):
    values, ids = scale_ids(matrix.group_scale)
    assert torch.equal(values[ids.long()].view(torch.int32), matrix.group_scale.view(torch.int32))
    assert values.numel() == torch.unique(matrix.group_scale.view(torch.int32)).numel()


def test_block_keys_match_the_reference_histogram_max_code_and_amax(matrix):
    keys = BlockKeys.of(matrix)
    block_codes, _ = flat_blocks(matrix.codes, matrix.group_scale)
    histogram = keys.histogram.view(torch.uint8).view(-1, 8).t().to(torch.float32)
    assert torch.equal(histogram, magnitude_histogram(block_codes))
    assert torch.equal(keys.max_code, block_max_code(block_codes).to(torch.int32))
    assert torch.equal(keys.amax(), matrix.amax())


def test_group_code_squares_are_the_integer_sums(matrix):
    squares = matrix.codes.to(torch.int32).square().view(matrix.shape[0], -1, 32).sum(-1, dtype=torch.int32)
    assert torch.equal(group_code_squares(code_bytes(matrix)), squares)


def test_encode_by_lookup_is_encode_with_block_scales_for_any_block_scale(matrix):
    gen = torch.Generator().manual_seed(0)
    bits = torch.randint(0, 256, (matrix.shape[0], matrix.shape[1] // 16), generator=gen, dtype=torch.uint8)
    bits.view(-1)[:256] = torch.arange(256, dtype=torch.int32).to(torch.uint8)  # NaN, zero and negative scales too
    values, ids = scale_ids(matrix.group_scale)
    for weight_scale_2 in (torch.tensor(1 / 2688.0), torch.tensor(2.0**-14), torch.tensor(3.7e-3)):
        ours = encode_blocks(code_bytes(matrix), values, ids.repeat_interleave(2, dim=1), bits, weight_scale_2)
        theirs = pack_e2m1(encode_with_block_scales(matrix.values(), bits.view(torch.float8_e4m3fn), weight_scale_2))
        assert torch.equal(ours, theirs)


def _same_search(ours, theirs) -> None:
    assert torch.equal(ours.chosen_bits, theirs.chosen_bits)
    assert torch.equal(ours.baseline_bits, theirs.baseline_bits)
    for a, b in ((ours.chosen_error, theirs.chosen_error), (ours.baseline_error, theirs.baseline_error)):
        assert torch.equal(a.nan_to_num(-1.0), b.nan_to_num(-1.0))  # bit for bit (NaN once squares overflow)


@pytest.mark.usefixtures("small_steps")
def test_key_table_search_matches_the_reference(matrix):
    amax = matrix.amax()
    weight_scale_2 = power_of_two_tensor_scale(amax, INT4_AWARE_RULE.tensor_scale_headroom)
    baseline_scale_2 = tensor_scale_from_amax(amax)
    keys = BlockKeys.of(matrix)
    table = KeyTable(keys.values, INT4_AWARE_RULE, weight_scale_2, baseline_scale_2)
    reference = search_reference(matrix, weight_scale_2, baseline_scale_2, INT4_AWARE_RULE)
    if table.usable():
        _same_search(table.search(keys, error_total_rows(matrix, INT4_AWARE_RULE.count)), reference)
    _same_search(search_by_scale_table(matrix, keys, weight_scale_2, baseline_scale_2, INT4_AWARE_RULE), reference)


def test_scale_table_search_matches_the_reference_for_the_sweep():
    matrix = MATRICES["edge"]()
    amax = matrix.amax()
    weight_scale_2, baseline_scale_2 = torch.tensor(2.0**-9), tensor_scale_from_amax(amax)
    reference = search_reference(matrix, weight_scale_2, baseline_scale_2, EveryE4M3Scale())
    keys = BlockKeys.of(matrix)
    _same_search(search_by_scale_table(matrix, keys, weight_scale_2, baseline_scale_2, EveryE4M3Scale()), reference)


def test_scale_table_errors_are_the_per_block_errors():
    m = realistic_int4(16, 256, seed=9, row_spread=2.0)
    t = torch.tensor(2.0**-9)
    block_codes, block_scale = flat_blocks(m.codes, m.group_scale)
    histogram = magnitude_histogram(block_codes)
    keys = BlockKeys.of(m)
    table = ScaleTable(keys.values, t)
    rule_bits = INT4_AWARE_RULE.bits(block_max_code(block_codes), block_scale, t)
    for bits in (rule_bits, EveryE4M3Scale().bits(block_max_code(block_codes), block_scale, t)):
        ours = table.errors(histogram.t(), keys.block_id.reshape(-1), bits)
        assert torch.equal(ours, candidate_errors(histogram, block_scale, bits, t))


def test_the_key_table_refuses_errors_that_could_overflow():
    tables = {}
    for name in ("edge", "overflowing"):
        m = MATRICES[name]()
        amax = m.amax()
        keys = BlockKeys.of(m)
        scales_2 = power_of_two_tensor_scale(amax, INT4_AWARE_RULE.tensor_scale_headroom), tensor_scale_from_amax(amax)
        tables[name] = KeyTable(keys.values, INT4_AWARE_RULE, *scales_2)
    assert tables["edge"].usable() and not tables["overflowing"].usable()


def test_model_optimizer_bits_by_key_and_encode_by_lookup_are_quantize_nvfp4(matrix):
    keys = BlockKeys.of(matrix)
    for weight_scale_2 in (tensor_scale_from_amax(matrix.amax()), torch.tensor(2.0**-10)):
        reference = quantize_nvfp4(matrix.values(), weight_scale_2)
        bits = key_bits(keys, weight_scale_2)
        assert torch.equal(bits, model_optimizer_block_bits(matrix, weight_scale_2))
        assert torch.equal(bits, reference.weight_scale.view(torch.uint8))
        packed = encode_blocks(code_bytes(matrix), keys.values, keys.block_id, bits, weight_scale_2)
        assert torch.equal(packed, reference.weight)


@pytest.mark.parametrize("method", [ScaleMethod.AMAX, ScaleMethod.INT4_AWARE, ScaleMethod.SWEEP], ids=lambda m: m.value)
def test_quantize_int4_matrices_equals_the_reference_path(method):
    groups = [[edge_matrix(7), realistic_int4(48, 512, seed=8)], [edge_matrix(9, scales="fp32")], [edge_matrix(10)]]
    for g in groups:
        ours = quantize_int4_matrices(g, method)
        theirs = quantize_int4_matrices([Int4Matrix(m.codes, m.group_scale) for m in g], method, path=SearchPath.REFERENCE)
        for x, y in zip(ours, theirs):
            _same_tensors(x, y)


def _reference_error_sums(m: Int4Matrix, q: NVFP4Tensor, step_elements: int) -> torch.Tensor:
    """The error statistics as `error_sums` computed them before the lookups (one pass per step)."""
    totals = torch.zeros(4, dtype=torch.float64)
    step = max(1, step_elements // m.shape[1])
    for start in range(0, m.shape[0], step):
        rows = slice(start, start + step)
        values = decode_e2m1(unpack_e2m1(q.weight[rows]))
        scale = q.weight_scale[rows].to(torch.float32) * q.weight_scale_2
        dequantized = (values.view(values.shape[0], -1, 16) * scale.unsqueeze(-1)).view(values.shape)
        diff = dequantized - m.rows(start, start + step).values()
        lowest, highest = torch.aminmax(diff)
        norm = torch.linalg.vector_norm(diff, dtype=torch.float64)
        codes = m.codes[rows].view(diff.shape[0], -1, 32).to(torch.int16)
        squares = (m.group_scale[rows].double().square() * codes.square().sum(-1, dtype=torch.int32).double()).sum()
        inexact = torch.count_nonzero(diff).to(torch.float64)
        totals = totals + torch.stack([norm * norm, squares, inexact, torch.zeros_like(norm)])
        totals[3] = torch.maximum(totals[3], torch.maximum(-lowest, highest).to(torch.float64))
    return totals


@pytest.mark.parametrize("steps", ["default", "small"])
def test_error_sums_are_bit_identical_to_the_reference(matrix, steps, request):
    if steps == "small":
        request.getfixturevalue("small_steps")
    step_elements = stats_module._STATS_STEP_ELEMENTS["cpu"]
    gen = torch.Generator().manual_seed(1)
    converted = quantize_int4_matrices([matrix])[0]
    weight = torch.randint(0, 256, converted.weight.shape, generator=gen, dtype=torch.uint8)
    bits = torch.randint(0, 256, converted.weight_scale.shape, generator=gen, dtype=torch.uint8)
    random = NVFP4Tensor(weight, bits.view(torch.float8_e4m3fn), converted.weight_scale_2)
    for q in (converted, random):  # random bytes: NaN and negative block scales, -0 codes
        ours, theirs = error_sums(matrix, q), _reference_error_sums(matrix, q, step_elements)
        assert torch.equal(ours.nan_to_num(-1.0), theirs.nan_to_num(-1.0)), (ours, theirs)


def test_decode_and_dequantize_by_lookup():
    every_byte = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(3, 2)
    reference = decode_e2m1(unpack_e2m1(every_byte))
    assert torch.equal(decode_e2m1_packed(every_byte).view(torch.int32), reference.view(torch.int32))  # -0.0 too
    bits = ((torch.arange(192, dtype=torch.int32) * 4 + 3) % 256).to(torch.uint8).view(3, 64)  # NaN: 0x7F, 0xFF
    q = NVFP4Tensor(every_byte, bits.view(torch.float8_e4m3fn), torch.tensor(3.5e-3))
    scale = bits.view(torch.float8_e4m3fn).to(torch.float32) * q.weight_scale_2
    expected = (reference.view(3, -1, 16) * scale.unsqueeze(-1)).view(reference.shape)
    assert torch.equal(dequantize_nvfp4(q).nan_to_num(-1.0), expected.nan_to_num(-1.0))
