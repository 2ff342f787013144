"""The `int4-aware` search and NVFP4 encode as two fused Triton kernels (the CUDA conversion's hot path).

The torch path (`search_block_bits(per_block=True)` + `_encode_rows`) runs a few dozen elementwise kernels per
matrix over `[7 candidates, 8 magnitudes, blocks]` fp32 temporaries: ~1.4 GB/s of INT4 input on an H200,
bound by memory traffic. Here one program handles `BLOCKS` 16-blocks held in registers and writes only bytes:

    _search_kernel: per block the magnitude histogram, the 7 candidates, their errors, the winner (ties toward
                    the smaller scale), Model Optimizer's amax bits under the baseline tensor scale and
                    per-program float64 error totals (for the group's "keep amax if better" fallback);
    _encode_kernel: the E2M1 codes under the final scale (the winner, or amax's when the group fell back: read
                    from a device flag, so nothing is read back), packed even column in the low nibble.

Bit-exact with the torch path (and so with the CPU): every value is produced by the same IEEE fp32 operations
in the same order — `k*s`, `float(bits) * weight_scale_2`, correctly rounded division (`tl.div_rn`: Triton's
`/` is an approximate division), E2M1 rounding by the same step/round-half-even arithmetic, products then the
same pairwise sum over the 8 magnitudes — and the kernels are compiled with `enable_fp_fusion=False`, so no
`a - b*c` is contracted into a fused multiply-add (which rounds once instead of twice). E4M3 rounding is done
on the fp32 bit pattern (round to nearest even), the cast torch performs after clamping to [2**-9, 448].
The error totals are summed per program, then over programs: a different float64 order than the CPU's, which
could only matter for a near-exact tie of the fallback comparison (never observed; see `quantize.py`).

Only imported on CUDA when Triton is installed (`available()`); `KIMI_NVFP4_TRITON=0` turns it off.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ..constants import NVFP4_BLOCK_SIZE
from ..e2m1 import _DECISION_BOUNDS

__all__ = ["BLOCKS_PER_PROGRAM", "e4m3_bits_of", "enabled", "encode_blocks", "search_blocks"]

# 16-blocks per program: one block per thread with 4 warps; tuned on the H200 (docs/benchmarks.md).
BLOCKS_PER_PROGRAM = 128
_NUM_WARPS = 4
# Triton compiles `a * b + c` into one fused multiply-add unless told not to; the torch path rounds twice.
_COMPILE = {"enable_fp_fusion": False, "num_warps": _NUM_WARPS}

_E4M3_ZERO_BLOCK_BITS = tl.constexpr(0x38)  # 1.0: Model Optimizer's scale for an all-zero block
_B0, _B1, _B2, _B3, _B4, _B5, _B6 = _DECISION_BOUNDS  # E2M1 rounding bounds (ties folded in, see e2m1.py)


@triton.jit
def _e4m3_bits(x):
    """fp32 -> e4m3fn bit pattern (int32), after clamping to [2**-9, 448], rounding to nearest even."""
    x = tl.minimum(tl.maximum(x, 0.001953125), 448.0)
    xb = x.to(tl.int32, bitcast=True)
    # Normal e4m3 (x >= 2**-6): drop 20 of fp32's 23 mantissa bits with round-half-even, rebias 127 -> 7.
    normal = ((xb + 0x7FFFF + ((xb >> 20) & 1)) >> 20) - (120 << 3)
    # Subnormal e4m3: m * 2**-9; x * 512 is exact and < 8, and adding 2**23 rounds it half-even to an integer.
    y = x * 512.0
    sub = ((y + 8388608.0) - 8388608.0).to(tl.int32)
    return tl.where(xb >= (121 << 23), normal, sub)


@triton.jit
def _e4m3_value(bits):
    """e4m3fn bit pattern (int32, 1..126) -> its fp32 value (exact)."""
    e = bits >> 3
    m = bits & 7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    sub = m.to(tl.float32) * 0.001953125
    return tl.where(e == 0, sub, normal)


@triton.jit
def _round_e2m1_magnitude(x):
    """`e2m1.round_e2m1_magnitude`: a multiple of the E2M1 step at x's binade, half-even, at most 6."""
    biased_exponent = x.to(tl.int32, bitcast=True) >> 23
    step = (tl.maximum(biased_exponent - 1, 126) << 23).to(tl.float32, bitcast=True)
    y = tl.minimum(tl.div_rn(x, step), 4.0)  # exact; < 4 for every finite x (inf -> 4 -> inf, as torch)
    rounded = (y + 8388608.0) - 8388608.0
    return tl.minimum(rounded * step, 6.0)


@triton.jit
def _term(k: tl.constexpr, s, d, n):
    value = s * k
    error = value - _round_e2m1_magnitude(tl.div_rn(value, d)) * d
    return (error * error) * n


@triton.jit
def _block_error(bits, s, scale_2, n1, n2, n3, n4, n5, n6, n7, n8):
    """Squared error of a block under e4m3 `bits`: the pairwise sum of `block_search.candidate_errors`."""
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
    """The scan step of `block_search.select_best`: the clamped candidate replaces the best so far if its error is
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

    # Model Optimizer's amax rule under its own tensor scale (`quantize.amax_block_bits`): zero -> 1.0.
    baseline_target = tl.div_rn(block_amax, 6.0 * base2)
    baseline_bits = _e4m3_bits(tl.where(baseline_target == 0.0, 1.0, baseline_target))
    tl.store(amax_ptr + block, baseline_bits.to(tl.uint8), mask=live)
    if SEARCH:
        baseline_error = _block_error(baseline_bits, s, base2, n1, n2, n3, n4, n5, n6, n7, n8)
        # Candidates in `candidates.int4_aware_bits` order: amax target +0 +1, four-over-six -1 0 +1, aligned -1 0.
        amax_centre = _e4m3_bits(tl.div_rn(block_amax, 6.0 * ws2))
        fos_centre = _e4m3_bits(tl.div_rn(block_amax, 4.0 * ws2))
        aligned = tl.where(max_code >= 7, 2.0, 1.0)
        aligned_centre = _e4m3_bits(tl.div_rn(aligned * s, ws2))

        best_bits = _clamp_bits(amax_centre)
        best_error = _block_error(best_bits, s, ws2, n1, n2, n3, n4, n5, n6, n7, n8)
        best_error, best_bits = _consider(amax_centre + 1, best_error, best_bits, s, ws2, n1, n2, n3, n4, n5, n6, n7, n8)
        best_error, best_bits = _consider(fos_centre - 1, best_error, best_bits, s, ws2, n1, n2, n3, n4, n5, n6, n7, n8)
        best_error, best_bits = _consider(fos_centre, best_error, best_bits, s, ws2, n1, n2, n3, n4, n5, n6, n7, n8)
        best_error, best_bits = _consider(fos_centre + 1, best_error, best_bits, s, ws2, n1, n2, n3, n4, n5, n6, n7, n8)
        best_error, best_bits = _consider(
            aligned_centre - 1, best_error, best_bits, s, ws2, n1, n2, n3, n4, n5, n6, n7, n8)
        best_error, best_bits = _consider(aligned_centre, best_error, best_bits, s, ws2, n1, n2, n3, n4, n5, n6, n7, n8)

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
    codes_ptr, scale_ptr, chosen_ptr, amax_ptr, ws2_ptr, base2_ptr, fallback_ptr, packed_ptr, bits_ptr, stats_ptr,
    num_blocks, B0, B1, B2, B3, B4, B5, B6,
    BLOCKS: tl.constexpr, STATS: tl.constexpr,
):
    pid = tl.program_id(0)
    block = pid * BLOCKS + tl.arange(0, BLOCKS)
    live = block < num_blocks
    fallback = tl.load(fallback_ptr) != 0
    chosen = tl.load(chosen_ptr + block, mask=live, other=_E4M3_ZERO_BLOCK_BITS).to(tl.int32)
    amax_bits = tl.load(amax_ptr + block, mask=live, other=_E4M3_ZERO_BLOCK_BITS).to(tl.int32)
    bits = tl.where(fallback, amax_bits, chosen)
    scale_2 = tl.where(fallback, tl.load(base2_ptr), tl.load(ws2_ptr))
    d = _e4m3_value(bits) * scale_2  # `encode_with_block_scales`: product first, then one division
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
    tl.store(bits_ptr + block, bits.to(tl.uint8), mask=live)
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


def search_blocks(
    codes: torch.Tensor, group_scale: torch.Tensor, weight_scale_2: torch.Tensor, baseline_scale_2: torch.Tensor,
    *, search: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """`search_block_bits(int4-aware, per_block=True)` in one kernel: chosen bits, amax bits (uint8 `[out, in/16]`)
    and the float64 0-d error totals of both (summed per program, then over programs). With `search=False` only
    Model Optimizer's amax bits (under `baseline_scale_2`) are computed; the other three are None."""
    codes, group_scale, num_blocks = _flat_inputs(codes, group_scale)
    programs = _programs(num_blocks)
    shape = (codes.shape[0], codes.shape[1] // NVFP4_BLOCK_SIZE)
    baseline = torch.empty(shape, dtype=torch.uint8, device=codes.device)
    chosen = torch.empty_like(baseline) if search else baseline
    totals = torch.zeros((programs if search else 0, 2), dtype=torch.float64, device=codes.device)
    if num_blocks:
        _search_kernel[(programs,)](
            codes, group_scale, weight_scale_2, baseline_scale_2, chosen, baseline, totals, num_blocks,
            BLOCKS=BLOCKS_PER_PROGRAM, SEARCH=search, **_COMPILE,
        )
    if not search:
        return None, baseline, None, None
    sums = totals.sum(dim=0)
    return chosen, baseline, sums[0], sums[1]


def encode_blocks(
    codes: torch.Tensor, group_scale: torch.Tensor, chosen: torch.Tensor, amax_bits: torch.Tensor,
    weight_scale_2: torch.Tensor, baseline_scale_2: torch.Tensor, fallback: torch.Tensor, *, stats: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Packed E2M1 weight uint8 `[out, in/2]`, final block-scale bits uint8 `[out, in/16]` and, with `stats`, the
    float64 `[4]` row of `stats.error_sums` (same quantities; float64 sums in the kernel's order): `chosen` under
    `weight_scale_2`, or, where the device bool `fallback` is set, `amax_bits` under `baseline_scale_2`."""
    codes, group_scale, num_blocks = _flat_inputs(codes, group_scale)
    programs = _programs(num_blocks)
    packed = torch.empty((codes.shape[0], codes.shape[1] // 2), dtype=torch.uint8, device=codes.device)
    bits = torch.empty((codes.shape[0], codes.shape[1] // NVFP4_BLOCK_SIZE), dtype=torch.uint8, device=codes.device)
    partial = torch.zeros((max(programs, 1), 4), dtype=torch.float64, device=codes.device)
    if num_blocks:
        _encode_kernel[(programs,)](
            codes, group_scale, chosen.contiguous(), amax_bits.contiguous(), weight_scale_2, baseline_scale_2,
            fallback.to(torch.int8), packed, bits, partial, num_blocks, _B0, _B1, _B2, _B3, _B4, _B5, _B6,
            BLOCKS=BLOCKS_PER_PROGRAM, STATS=stats, **_COMPILE,
        )
    if not stats:
        return packed, bits, None
    row = torch.cat([partial[:, :3].sum(dim=0), partial[:, 3].amax().reshape(1)])
    return packed, bits, row


def enabled() -> bool:
    """Whether `KIMI_NVFP4_TRITON` allows the kernels (default yes; `0` selects the torch path, for A/B runs)."""
    return os.environ.get("KIMI_NVFP4_TRITON", "1") != "0"
