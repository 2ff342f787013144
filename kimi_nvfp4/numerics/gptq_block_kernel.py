"""One 16-column NVFP4 block of GPTQ as one Triton kernel (the GPU path of `gptq_solver`): the block's scale choice
and its 16 column steps.

`gptq_solver.gptq_quantize` works through a block as a few dozen small torch kernels: GPTQ's weights of the block
from the pushed ones, the scale candidates' errors over `[candidates, experts, rows, 16]`, the choice, then per
column about 25 elementwise kernels over `[experts, rows]`. At K2.6's gate/up width that is ~450 blocks per batch
of experts, each bound by launches and by the candidates' temporaries. Here one program holds a tile of rows of one
expert's block in registers and does all of it; only the codes, the scale bits and the errors are written.

Bit-exact with the torch path it replaces (`gptq_solver._block_reference`): the same IEEE operations in the same
order -- the 16-term sum of `(w - t) P_BB^-1` from zero in column order; the scale candidates (the search's bits,
then the window around the block's amax/6 scale rounded to E4M3 as `_e4m3_bits` does, clamped to the positive E4M3
codes), each one's error `sum_j (|v_j| - e2m1(fp32(|v_j| / d)) d)**2 / U_jj**2` as the pairwise tree of
`fixed_order_sum` (a sum of two values does not depend on their order), the first least one kept (NaN never
wins); `fp32(w / d)` with a correctly rounded float64 division (for float64 PTX has only `div.rn`; `tl.div_rn`,
which fp32 needs, is fp32-only) and a round-to-nearest-even cast, the E2M1 code by `e2m1.encode_e2m1`'s decision
bounds, the value `e2m1 * d` in fp32 widened to float64, and every update as a product then a difference
(compiled with `enable_fp_fusion=False`, so no product is fused into an addition). A column is read out of the
register tile as a masked sum, which can turn a -0.0 weight into +0.0; E2M1 encodes both as code 0 and a zero
error updates nothing, so codes and the errors' values agree (only a zero's sign can differ). Tests:
`tests/numerics/test_gptq_block_kernel.py` (Triton's CPU interpreter here; the compiled kernel on CUDA).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .constants import E2M1_MAX, NVFP4_BLOCK_SIZE
from .e2m1 import _DECISION_BOUNDS
from .e4m3 import E4M3_MAX_BITS, E4M3_MIN_POSITIVE_BITS
from .methods.search.triton_kernels import _e2m1_value, _e4m3_bits, _e4m3_value, _round_e2m1_magnitude

__all__ = ["gptq_block"]

_ROWS_PER_PROGRAM = 64
_COMPILE = {"enable_fp_fusion": False, "num_warps": 4}
_B0, _B1, _B2, _B3, _B4, _B5, _B6 = (tl.constexpr(b) for b in _DECISION_BOUNDS)
_E2M1_MAX = tl.constexpr(E2M1_MAX)  # the amax/6 scale's 6
_LOWEST_BITS = tl.constexpr(E4M3_MIN_POSITIVE_BITS)
_HIGHEST_BITS = tl.constexpr(E4M3_MAX_BITS)


@triton.jit
def _pair_sum(x, ROWS: tl.constexpr, HALF: tl.constexpr):
    """`[ROWS, 2 * HALF]` -> `[ROWS, HALF]`: x[:, 0::2] + x[:, 1::2], one level of `fixed_order_sum`'s tree."""
    even, odd = tl.split(tl.reshape(x, [ROWS, HALF, 2]))
    return even + odd


@triton.jit
def _candidate_error(bits, magnitude, cost, scale_2, ROWS: tl.constexpr):
    """Per row, `sum_j cost_j (|v_j| - q_j)**2` under E4M3 `bits` (int32 `[ROWS]`), summed as a pairwise tree."""
    d = _e4m3_value(bits) * scale_2  # fp32, as `e4m3_bits_to_fp32(bits) * weight_scale_2`
    x = (magnitude / d.to(tl.float64)[:, None]).to(tl.float32)
    error = magnitude - (_round_e2m1_magnitude(x) * d[:, None]).to(tl.float64)
    terms = error * error * cost[None, :]
    terms = _pair_sum(terms, ROWS, 8)
    terms = _pair_sum(terms, ROWS, 4)
    terms = _pair_sum(terms, ROWS, 2)
    even, odd = tl.split(terms)
    total = even + odd
    return tl.where(total != total, float("inf"), total)


@triton.jit
def _gptq_block_kernel(
    batch_ptr, weight_ptr, inverse_ptr, restore_ptr, search_ptr, scale_2_ptr, codes_ptr, bits_ptr, errors_ptr,
    rows, blocks, batch_stride_e, batch_stride_r, weight_stride_e, weight_stride_r, codes_stride_e, codes_stride_r,
    bits_stride_e, bits_stride_r, search_stride_e, search_stride_r,
    block_column, column, block,
    ROWS: tl.constexpr, LOW: tl.constexpr, HIGH: tl.constexpr,
):
    expert = tl.program_id(1).to(tl.int64)
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    live = row < rows
    cols = tl.arange(0, 16)
    batch_rows = batch_ptr + expert * batch_stride_e + row * batch_stride_r + block_column
    weight_rows = weight_ptr + expert * weight_stride_e + row * weight_stride_r + column
    triangle = (expert * blocks + block) * 256  # U_BB and P_BB^-1 are [E, blocks, 16, 16], contiguous
    original = tl.load(weight_rows[:, None] + cols[None, :], mask=live[:, None], other=0.0)
    # GPTQ's weights of the block: v = w - (w - t) P_BB^-1, summed over j from zero
    undo = tl.zeros([ROWS, 16], dtype=tl.float64)
    for j in tl.range(16):
        pushed = tl.load(weight_rows + j, mask=live, other=0.0) - tl.load(batch_rows + j, mask=live, other=0.0)
        m_row = tl.load(restore_ptr + triangle + j * 16 + cols)
        undo = undo + pushed[:, None] * m_row[None, :]
    v = original - undo
    # the block's scale: the search's bits, then the window around the amax/6 scale; the first least error wins
    pivots = tl.load(inverse_ptr + triangle + cols * 17)  # U_jj
    cost = 1.0 / (pivots * pivots)
    scale_2 = tl.load(scale_2_ptr + expert)
    magnitude = tl.abs(v)
    centre = _e4m3_bits(tl.div_rn(tl.max(magnitude, axis=1).to(tl.float32), _E2M1_MAX * scale_2))
    best = tl.load(search_ptr + expert * search_stride_e + row * search_stride_r + block, mask=live, other=1)
    best = best.to(tl.int32)
    least = _candidate_error(best, magnitude, cost, scale_2, ROWS)
    for offset in tl.range(LOW, HIGH + 1):
        candidate = tl.minimum(tl.maximum(centre + offset, _LOWEST_BITS), _HIGHEST_BITS)
        error = _candidate_error(candidate, magnitude, cost, scale_2, ROWS)
        better = error < least
        best = tl.where(better, candidate, best)
        least = tl.where(better, error, least)
    tl.store(bits_ptr + expert * bits_stride_e + row * bits_stride_r + block, best.to(tl.uint8), mask=live)
    d = _e4m3_value(best) * scale_2
    code_base = codes_ptr + expert * codes_stride_e + row * codes_stride_r + column
    error_base = errors_ptr + expert * batch_stride_e + row * batch_stride_r + block_column
    for j in tl.range(16):
        value = tl.sum(tl.where(cols[None, :] == j, v, 0.0), axis=1)
        x = (value / d.to(tl.float64)).to(tl.float32)
        a = tl.abs(x)
        index = ((a > _B0).to(tl.int32) + (a > _B1).to(tl.int32) + (a > _B2).to(tl.int32) + (a > _B3).to(tl.int32)
                 + (a > _B4).to(tl.int32) + (a > _B5).to(tl.int32) + (a > _B6).to(tl.int32))
        negative = x < 0.0
        magnitude_j = _e2m1_value(index) * d
        q = tl.where(negative, -magnitude_j, magnitude_j).to(tl.float64)
        u_row = tl.load(inverse_ptr + triangle + j * 16 + cols)  # U_BB[j, :]
        pivot = tl.sum(tl.where(cols == j, u_row, 0.0), axis=0)
        step = (value - q) / pivot
        tl.store(code_base + j, (index | (negative.to(tl.int32) << 3)).to(tl.uint8), mask=live)
        tl.store(error_base + j, tl.load(weight_rows + j, mask=live, other=0.0) - q, mask=live)
        v = tl.where(cols[None, :] > j, v - step[:, None] * u_row[None, :], v)


def gptq_block(
    batch: torch.Tensor, weight: torch.Tensor, block_start: int, column: int, inverse: torch.Tensor,
    restore: torch.Tensor, search_bits: torch.Tensor, weight_scale_2: torch.Tensor, window: tuple[int, int],
    codes: torch.Tensor, bits: torch.Tensor, errors: torch.Tensor,
) -> None:
    """One block (`gptq_solver._block_reference`, which this equals bit for bit; the same arguments)."""
    experts, rows, _ = batch.shape
    for name, t in (("batch", batch), ("weight", weight), ("codes", codes), ("errors", errors), ("bits", bits),
                    ("search_bits", search_bits)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have unit stride in its last dimension")
    if errors.stride() != batch.stride():
        raise ValueError("errors must be laid out as batch")
    for name, t in (("inverse", inverse), ("restore", restore)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    grid = (triton.cdiv(rows, _ROWS_PER_PROGRAM), experts)
    _gptq_block_kernel[grid](
        batch, weight, inverse, restore, search_bits, weight_scale_2.contiguous(), codes, bits, errors,
        rows, inverse.shape[1], batch.stride(0), batch.stride(1), weight.stride(0), weight.stride(1),
        codes.stride(0), codes.stride(1), bits.stride(0), bits.stride(1), search_bits.stride(0),
        search_bits.stride(1), block_start, column, column // NVFP4_BLOCK_SIZE,
        ROWS=_ROWS_PER_PROGRAM, LOW=window[0], HIGH=window[1], **_COMPILE,
    )


assert NVFP4_BLOCK_SIZE == 16  # the kernel's tile width
