"""A candidate rule's search and the NVFP4 encode as two fused Triton kernels (the CUDA conversion's hot path).

The reference (`reference.search_reference` + `encode.encode_rows`) runs a few dozen elementwise kernels per
matrix over `[candidates, 8 magnitudes, blocks]` fp32 temporaries: ~1.4 GB/s of INT4 input on an H200, bound by
memory traffic. Here one program handles `BLOCKS` 16-blocks held in registers and writes only bytes:

    _search_kernel: per block the magnitude histogram, the rule's candidates (constexprs from the `CandidateRule`,
                    `kernel_constants`), their errors, the winner (ties toward the smaller scale), Model
                    Optimizer's amax bits under the baseline tensor scale and per-program float64 error totals
                    (for the group's "keep amax if better" fallback); with SEARCH=False only the amax bits;
    _encode_kernel: the E2M1 codes under given block scales and tensor scale (the group's final choice, selected
                    on the device by `group.py`, so nothing is read back), packed even column in the low nibble,
                    and optionally the error statistics.

Bit-exact with the reference (and so with the CPU): every value is produced by the same IEEE fp32 operations
in the same order — `k*s`, `float(bits) * weight_scale_2`, correctly rounded division (`tl.div_rn`: Triton's
`/` is an approximate division), E2M1 rounding by the same step/round-half-even arithmetic, products then the
same pairwise sum over the 8 magnitudes — and the kernels are compiled with `enable_fp_fusion=False`, so no
`a - b*c` is contracted into a fused multiply-add (which rounds once instead of twice). E4M3 rounding is done
on the fp32 bit pattern (round to nearest even), the cast torch performs after clamping to [2**-9, 448].
The error totals are summed per program, then over programs: a different float64 order than the CPU's, which
could only matter for a near-exact tie of the fallback comparison (never observed).

Imported only where `paths.choose_path` picks the Triton path (CUDA with Triton installed).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...constants import E2M1_MAX, E4M3_MAX, E4M3_MIN_BLOCK_SCALE, NVFP4_BLOCK_SIZE
from ...e2m1 import _DECISION_BOUNDS
from .result import SearchResult
from .rule import CandidateRule, CandidateSet

__all__ = [
    "BLOCKS_PER_PROGRAM",
    "e4m3_bits_of",
    "encode_blocks",
    "kernel_constants",
    "model_optimizer_bits",
    "search_blocks",
    "supports",
]

# 16-blocks per program: one block per thread with 4 warps (bench/speed/triton_launch_shapes.py sweeps these; no result
# file records a tuning run yet, so the values are a starting point, not a measured optimum).
BLOCKS_PER_PROGRAM = 128
_NUM_WARPS = 4
# Triton compiles `a * b + c` into one fused multiply-add unless told not to; the torch path rounds twice.
_COMPILE = {"enable_fp_fusion": False, "num_warps": _NUM_WARPS}

_E4M3_ZERO_BLOCK_BITS = tl.constexpr(0x38)  # 1.0: Model Optimizer's scale for an all-zero block
_E4M3_LOWEST = tl.constexpr(E4M3_MIN_BLOCK_SCALE)  # Model Optimizer's clamp of block scales before the cast
_E4M3_HIGHEST = tl.constexpr(E4M3_MAX)
_E4M3_SUBNORMAL_STEP = tl.constexpr(2.0**-9)  # E4M3 subnormals are m * 2**-9
_E2M1_MAX = tl.constexpr(E2M1_MAX)  # also Model Optimizer's block scale rule: block_amax / (6 * weight_scale_2)
_FRACTION_TARGETS = 2  # the search kernel's shape: two amax-fraction targets, then the aligned target
_B0, _B1, _B2, _B3, _B4, _B5, _B6 = _DECISION_BOUNDS  # E2M1 rounding bounds (ties folded in, see e2m1.py)


@triton.jit
def e4m3_bits_rn(x):
    """Non-negative fp32 (at most 448) -> e4m3fn bit pattern (int32), round to nearest even, subnormals and zero
    kept (activation block scales may round to them)."""
    xb = x.to(tl.int32, bitcast=True)
    # Normal e4m3 (x >= 2**-6): drop 20 of fp32's 23 mantissa bits with round-half-even, rebias 127 -> 7.
    normal = ((xb + 0x7FFFF + ((xb >> 20) & 1)) >> 20) - (120 << 3)
    # Subnormal e4m3: m * 2**-9; x * 512 is exact and < 8, and adding 2**23 rounds it half-even to an integer
    # (m = 8 is 2**-6, bits 0x08).
    y = x * 512.0
    sub = ((y + 8388608.0) - 8388608.0).to(tl.int32)
    return tl.where(xb >= (121 << 23), normal, sub)


@triton.jit
def _e4m3_bits(x):
    """fp32 -> e4m3fn bit pattern (int32), after clamping to [2**-9, 448] (Model Optimizer's block-scale clamp)."""
    return e4m3_bits_rn(tl.minimum(tl.maximum(x, _E4M3_LOWEST), _E4M3_HIGHEST))


@triton.jit
def _e4m3_value(bits):
    """e4m3fn bit pattern (int32, 1..126) -> its fp32 value (exact)."""
    e = bits >> 3
    m = bits & 7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    sub = m.to(tl.float32) * _E4M3_SUBNORMAL_STEP
    return tl.where(e == 0, sub, normal)


@triton.jit
def _round_e2m1_magnitude(x):
    """`e2m1.round_e2m1_magnitude`: a multiple of the E2M1 step at x's binade, half-even, at most 6."""
    biased_exponent = x.to(tl.int32, bitcast=True) >> 23
    step = (tl.maximum(biased_exponent - 1, 126) << 23).to(tl.float32, bitcast=True)
    y = tl.minimum(tl.div_rn(x, step), 4.0)  # exact; < 4 for every finite x (inf -> 4 -> inf, as torch)
    rounded = (y + 8388608.0) - 8388608.0
    return tl.minimum(rounded * step, _E2M1_MAX)


@triton.jit
def _term(k: tl.constexpr, s, d, n):
    value = s * k
    error = value - _round_e2m1_magnitude(tl.div_rn(value, d)) * d
    return (error * error) * n


@triton.jit
def _block_error(bits, s, scale_2, n1, n2, n3, n4, n5, n6, n7, n8):
    """Squared error of a block under e4m3 `bits`: the pairwise sum of `reference.candidate_errors`."""
    d = _e4m3_value(bits) * scale_2
    w1 = _term(1.0, s, d, n1)
    w2 = _term(2.0, s, d, n2)
    w3 = _term(3.0, s, d, n3)
    w4 = _term(4.0, s, d, n4)
    w5 = _term(5.0, s, d, n5)
    w6 = _term(6.0, s, d, n6)
    w7 = _term(7.0, s, d, n7)
    w8 = _term(8.0, s, d, n8)
    return ((w1 + w2) + (w3 + w4)) + ((w5 + w6) + (w7 + w8))


@triton.jit
def _clamp_bits(b):
    return tl.minimum(tl.maximum(b, 1), 126)


@triton.jit
def _consider(candidate, best_error, best_bits, s, scale_2, n1, n2, n3, n4, n5, n6, n7, n8):
    """The scan step of `reference.select_best`: the clamped candidate replaces the best so far if its error is
    smaller, or equal with a smaller scale."""
    bits = _clamp_bits(candidate)
    error = _block_error(bits, s, scale_2, n1, n2, n3, n4, n5, n6, n7, n8)
    take = (error < best_error) | ((error == best_error) & (bits < best_bits))
    return tl.where(take, error, best_error), tl.where(take, bits, best_bits)


@triton.jit
def _count(mag, k: tl.constexpr):
    return tl.sum((mag == k).to(tl.int32), axis=1).to(tl.float32)


@triton.jit
def _search_kernel(
    codes_ptr, scale_ptr, ws2_ptr, base2_ptr, chosen_ptr, amax_ptr, totals_ptr, num_blocks,
    BLOCKS: tl.constexpr, SEARCH: tl.constexpr,
    FIRST_DIVISOR: tl.constexpr, FIRST_LOWEST: tl.constexpr, FIRST_HIGHEST: tl.constexpr,
    SECOND_DIVISOR: tl.constexpr, SECOND_LOWEST: tl.constexpr, SECOND_HIGHEST: tl.constexpr,
    WIDE_FROM_CODE: tl.constexpr, WIDE_MULTIPLE: tl.constexpr, ALIGNED_LOWEST: tl.constexpr,
    ALIGNED_HIGHEST: tl.constexpr,
):
    pid = tl.program_id(0)
    block = pid * BLOCKS + tl.arange(0, BLOCKS)
    live = block < num_blocks
    codes = tl.load(codes_ptr + block[:, None] * 16 + tl.arange(0, 16)[None, :], mask=live[:, None], other=0)
    mag = tl.abs(codes.to(tl.int32))
    # A 16-block lies inside one 32-group: group index = block // 2 in row-major order.
    s = tl.abs(tl.load(scale_ptr + block // 2, mask=live, other=1.0))
    ws2 = tl.load(ws2_ptr)
    base2 = tl.load(base2_ptr)
    n1 = _count(mag, 1)
    n2 = _count(mag, 2)
    n3 = _count(mag, 3)
    n4 = _count(mag, 4)
    n5 = _count(mag, 5)
    n6 = _count(mag, 6)
    n7 = _count(mag, 7)
    n8 = _count(mag, 8)
    max_code = tl.max(mag, axis=1)
    block_amax = max_code.to(tl.float32) * s

    # Model Optimizer's amax rule under its own tensor scale (`rule.model_optimizer_bits`): zero -> 1.0.
    baseline_target = tl.div_rn(block_amax, _E2M1_MAX * base2)
    baseline_bits = _e4m3_bits(tl.where(baseline_target == 0.0, 1.0, baseline_target))
    tl.store(amax_ptr + block, baseline_bits.to(tl.uint8), mask=live)
    if SEARCH:
        baseline_error = _block_error(baseline_bits, s, base2, n1, n2, n3, n4, n5, n6, n7, n8)
        # The candidates in `CandidateRule.bits` order: the two amax-fraction targets, then the aligned one, each
        # at its rounded E4M3 value plus its offsets; the scan starts from the first (as `select_best` does).
        first_centre = _e4m3_bits(tl.div_rn(block_amax, FIRST_DIVISOR * ws2))
        second_centre = _e4m3_bits(tl.div_rn(block_amax, SECOND_DIVISOR * ws2))
        multiple = tl.where(max_code >= WIDE_FROM_CODE, WIDE_MULTIPLE, 1.0)
        aligned_centre = _e4m3_bits(tl.div_rn(multiple * s, ws2))

        best_bits = _clamp_bits(first_centre + FIRST_LOWEST)
        best_error = _block_error(best_bits, s, ws2, n1, n2, n3, n4, n5, n6, n7, n8)
        for offset in tl.static_range(FIRST_LOWEST + 1, FIRST_HIGHEST + 1):
            best_error, best_bits = _consider(
                first_centre + offset, best_error, best_bits, s, ws2, n1, n2, n3, n4, n5, n6, n7, n8)
        for offset in tl.static_range(SECOND_LOWEST, SECOND_HIGHEST + 1):
            best_error, best_bits = _consider(
                second_centre + offset, best_error, best_bits, s, ws2, n1, n2, n3, n4, n5, n6, n7, n8)
        for offset in tl.static_range(ALIGNED_LOWEST, ALIGNED_HIGHEST + 1):
            best_error, best_bits = _consider(
                aligned_centre + offset, best_error, best_bits, s, ws2, n1, n2, n3, n4, n5, n6, n7, n8)

        zero = (max_code == 0) | (s == 0.0)  # all-zero block: exact under any scale; keep 1.0
        chosen = tl.where(zero, _E4M3_ZERO_BLOCK_BITS, best_bits)
        tl.store(chosen_ptr + block, chosen.to(tl.uint8), mask=live)
        best_error = tl.where(live, best_error, 0.0)
        baseline_error = tl.where(live, baseline_error, 0.0)
        tl.store(totals_ptr + pid * 2, tl.sum(best_error.to(tl.float64), axis=0))
        tl.store(totals_ptr + pid * 2 + 1, tl.sum(baseline_error.to(tl.float64), axis=0))


@triton.jit
def _e2m1_value(index):
    """E2M1 magnitude index 0..7 -> 0, 0.5, 1, 1.5, 2, 3, 4, 6 (fp32, exact)."""
    low = index.to(tl.float32) * 0.5
    middle = (index - 2).to(tl.float32)
    high = ((index - 4) * 2).to(tl.float32)
    return tl.where(index < 4, low, tl.where(index < 6, middle, high))


@triton.jit
def _encode_kernel(
    codes_ptr, scale_ptr, bits_ptr, scale_2_ptr, packed_ptr, stats_ptr, num_blocks, B0, B1, B2, B3, B4, B5, B6,
    BLOCKS: tl.constexpr, STATS: tl.constexpr,
):
    pid = tl.program_id(0)
    block = pid * BLOCKS + tl.arange(0, BLOCKS)
    live = block < num_blocks
    bits = tl.load(bits_ptr + block, mask=live, other=_E4M3_ZERO_BLOCK_BITS).to(tl.int32)
    d = _e4m3_value(bits) * tl.load(scale_2_ptr)  # `encode_with_block_scales`: product first, then one division
    s = tl.load(scale_ptr + block // 2, mask=live, other=1.0)
    codes = tl.load(codes_ptr + block[:, None] * 16 + tl.arange(0, 16)[None, :], mask=live[:, None], other=0)
    value = codes.to(tl.float32) * s[:, None]
    x = tl.div_rn(value, d[:, None])
    ax = tl.abs(x)
    index = ((ax > B0).to(tl.int32) + (ax > B1).to(tl.int32) + (ax > B2).to(tl.int32) + (ax > B3).to(tl.int32)
             + (ax > B4).to(tl.int32) + (ax > B5).to(tl.int32) + (ax > B6).to(tl.int32))
    negative = x < 0.0
    code = index | (negative.to(tl.int32) << 3)
    low, high = tl.split(tl.reshape(code, (BLOCKS, 8, 2)))
    packed = (low | (high << 4)).to(tl.uint8)
    tl.store(packed_ptr + block[:, None] * 8 + tl.arange(0, 8)[None, :], packed, mask=live[:, None])
    if STATS:
        # `stats.error_sums` per program: the dequantized value as `dequantize_nvfp4` forms it (E2M1 value times
        # the same product `d`), its error against the exact INT4 value, then float64 sums. Padding blocks are
        # code 0 with error 0, so they add nothing.
        magnitude = _e2m1_value(index) * d[:, None]
        error = tl.where(negative, -magnitude, magnitude) - value
        error64 = error.to(tl.float64)
        value64 = value.to(tl.float64)
        tl.store(stats_ptr + pid * 4, tl.sum(tl.sum(error64 * error64, axis=1), axis=0))
        tl.store(stats_ptr + pid * 4 + 1, tl.sum(tl.sum(value64 * value64, axis=1), axis=0))
        tl.store(stats_ptr + pid * 4 + 2, tl.sum(tl.sum((error != 0.0).to(tl.float64), axis=1), axis=0))
        tl.store(stats_ptr + pid * 4 + 3, tl.max(tl.max(tl.abs(error64), axis=1), axis=0))


@triton.jit
def _e4m3_bits_kernel(x_ptr, out_ptr, n, BLOCKS: tl.constexpr):
    offsets = tl.program_id(0) * BLOCKS + tl.arange(0, BLOCKS)
    live = offsets < n
    tl.store(out_ptr + offsets, _e4m3_bits(tl.load(x_ptr + offsets, mask=live, other=1.0)).to(tl.uint8), mask=live)


def e4m3_bits_of(x: torch.Tensor) -> torch.Tensor:
    """The kernels' E4M3 rounding of fp32 `x` as uint8 bit patterns (for tests against torch's cast)."""
    x = x.contiguous().to(torch.float32)
    out = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    if x.numel():
        _e4m3_bits_kernel[(triton.cdiv(x.numel(), 1024),)](x, out, x.numel(), BLOCKS=1024, **_COMPILE)
    return out


def _programs(num_blocks: int) -> int:
    return triton.cdiv(num_blocks, BLOCKS_PER_PROGRAM)


def _flat_inputs(codes: torch.Tensor, group_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    if codes.shape[1] % (2 * NVFP4_BLOCK_SIZE):
        raise ValueError(f"input width {codes.shape[1]} is not a multiple of the INT4 group")
    return codes.contiguous(), group_scale.contiguous(), codes.numel() // NVFP4_BLOCK_SIZE


def kernel_constants(rule: CandidateRule) -> dict[str, float | int]:
    """The search kernel's constexprs, taken from `rule` (the one definition of the candidates)."""
    if not supports(rule):
        raise ValueError(f"the search kernel holds two amax-fraction targets and an aligned one, not {rule}")
    first, second = rule.fractions
    aligned = rule.aligned
    return {
        "FIRST_DIVISOR": first.divisor, "FIRST_LOWEST": first.lowest, "FIRST_HIGHEST": first.highest,
        "SECOND_DIVISOR": second.divisor, "SECOND_LOWEST": second.lowest, "SECOND_HIGHEST": second.highest,
        "WIDE_FROM_CODE": aligned.wide_from_code, "WIDE_MULTIPLE": aligned.wide_multiple,
        "ALIGNED_LOWEST": aligned.lowest, "ALIGNED_HIGHEST": aligned.highest,
    }


def supports(rule: CandidateSet | None) -> bool:
    """Whether the kernels run this candidate set: Model Optimizer's rule alone (None), or a rule of the kernel's
    shape (two amax-fraction targets, then the aligned target)."""
    return rule is None or (isinstance(rule, CandidateRule) and len(rule.fractions) == _FRACTION_TARGETS)


# Constants of the amax-only launch (SEARCH=False compiles the candidates away; any valid values do).
_NO_RULE = {
    "FIRST_DIVISOR": E2M1_MAX, "FIRST_LOWEST": 0, "FIRST_HIGHEST": 0, "SECOND_DIVISOR": E2M1_MAX,
    "SECOND_LOWEST": 0, "SECOND_HIGHEST": 0, "WIDE_FROM_CODE": 0, "WIDE_MULTIPLE": 1.0, "ALIGNED_LOWEST": 0,
    "ALIGNED_HIGHEST": 0,
}


def search_blocks(
    codes: torch.Tensor, group_scale: torch.Tensor, weight_scale_2: torch.Tensor, baseline_scale_2: torch.Tensor,
    rule: CandidateRule,
) -> SearchResult:
    """`reference.search_reference` for `rule` in one kernel (error totals summed per program, then over programs)."""
    codes, group_scale, num_blocks = _flat_inputs(codes, group_scale)
    programs = _programs(num_blocks)
    shape = (codes.shape[0], codes.shape[1] // NVFP4_BLOCK_SIZE)
    baseline = torch.empty(shape, dtype=torch.uint8, device=codes.device)
    chosen = torch.empty_like(baseline)
    totals = torch.zeros((programs, 2), dtype=torch.float64, device=codes.device)
    if num_blocks:
        _search_kernel[(programs,)](
            codes, group_scale, weight_scale_2, baseline_scale_2, chosen, baseline, totals, num_blocks,
            BLOCKS=BLOCKS_PER_PROGRAM, SEARCH=True, **kernel_constants(rule), **_COMPILE,
        )
    sums = totals.sum(dim=0)
    return SearchResult(chosen, baseline, sums[0], sums[1])


def model_optimizer_bits(codes: torch.Tensor, group_scale: torch.Tensor, weight_scale_2: torch.Tensor) -> torch.Tensor:
    """`rule.model_optimizer_bits` of every block (uint8 `[out, in/16]`): the search kernel without candidates."""
    codes, group_scale, num_blocks = _flat_inputs(codes, group_scale)
    bits = torch.empty((codes.shape[0], codes.shape[1] // NVFP4_BLOCK_SIZE), dtype=torch.uint8, device=codes.device)
    if num_blocks:
        unused = torch.empty((0,), dtype=torch.float64, device=codes.device)
        _search_kernel[(_programs(num_blocks),)](
            codes, group_scale, weight_scale_2, weight_scale_2, bits, bits, unused, num_blocks,
            BLOCKS=BLOCKS_PER_PROGRAM, SEARCH=False, **_NO_RULE, **_COMPILE,
        )
    return bits


def encode_blocks(
    codes: torch.Tensor, group_scale: torch.Tensor, bits: torch.Tensor, weight_scale_2: torch.Tensor,
    *, stats: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Packed E2M1 weight uint8 `[out, in/2]` under block-scale `bits` (uint8 `[out, in/16]`) and `weight_scale_2`
    (device 0-d), and with `stats` the float64 `[4]` row of `stats.error_sums` (same quantities; float64 sums in
    the kernel's order)."""
    codes, group_scale, num_blocks = _flat_inputs(codes, group_scale)
    programs = _programs(num_blocks)
    packed = torch.empty((codes.shape[0], codes.shape[1] // 2), dtype=torch.uint8, device=codes.device)
    partial = torch.zeros((max(programs, 1), 4), dtype=torch.float64, device=codes.device)
    if num_blocks:
        _encode_kernel[(programs,)](
            codes, group_scale, bits.contiguous(), weight_scale_2, packed, partial, num_blocks,
            _B0, _B1, _B2, _B3, _B4, _B5, _B6, BLOCKS=BLOCKS_PER_PROGRAM, STATS=stats, **_COMPILE,
        )
    if not stats:
        return packed, None
    return packed, torch.cat([partial[:, :3].sum(dim=0), partial[:, 3].amax().reshape(1)])
