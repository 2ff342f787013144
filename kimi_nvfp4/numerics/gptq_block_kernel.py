"""GPTQ's column steps over one 16-column NVFP4 block as one Triton kernel (the GPU path of `gptq_solver`).

`gptq_solver.gptq_quantize` quantizes a block's 16 columns one after another, and each column step is about 25 tiny
elementwise kernels over `[experts, rows]` (divide, round to fp32, E2M1 encode, decode, multiply, the error, the
update of the block's later columns): at K2.6's gate/up width that is ~180,000 launches per batch of experts, and
the H200 measured the loop launch-bound (bench/profile/gptq.py: 3.3 s of 3.8 s per 16-expert gate/up batch).
Here one program holds a tile of rows of one expert's block in registers and runs the 16 steps there.

Bit-exact with the torch loop it replaces (`gptq_solver._block_columns_reference`): the same IEEE operations in the
same order -- `fp32(w / d)` with a correctly rounded float64 division (for float64 PTX has only `div.rn`;
`tl.div_rn`, which the fp32 kernels need, is fp32-only) and a round-to-nearest-even cast, the E2M1 code by
`e2m1.encode_e2m1`'s decision bounds, the value `e2m1 * d` in fp32 widened to float64, the error `(w - q) / U_jj`, and the update `w_k - error * U_jk` as a product then a difference (compiled with
`enable_fp_fusion=False`, so no product is fused into the subtraction). A column is read out of the register tile
as a masked sum, which can turn a -0.0 weight into +0.0; E2M1 encodes both as code 0 and a zero error updates
nothing, so codes and the errors' values agree (only a zero's sign can differ). Tests:
`tests/numerics/test_gptq_block_kernel.py` (Triton's CPU interpreter here; the compiled kernel on CUDA).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .constants import NVFP4_BLOCK_SIZE
from .e2m1 import _DECISION_BOUNDS
from .methods.search.triton_kernels import _e2m1_value

__all__ = ["gptq_block_columns"]

_ROWS_PER_PROGRAM = 64
_COMPILE = {"enable_fp_fusion": False, "num_warps": 4}
_B0, _B1, _B2, _B3, _B4, _B5, _B6 = (tl.constexpr(b) for b in _DECISION_BOUNDS)


@triton.jit
def _gptq_block_kernel(
    batch_ptr, divisor_ptr, upper_ptr, codes_ptr, errors_ptr,
    rows, batch_stride_e, batch_stride_r, upper_stride_e, upper_stride_r, codes_stride_e, codes_stride_r,
    block_column, upper_column, codes_column,
    ROWS: tl.constexpr,
):
    expert = tl.program_id(1).to(tl.int64)
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    live = row < rows
    cols = tl.arange(0, 16)
    tile = batch_ptr + expert * batch_stride_e + row[:, None] * batch_stride_r + block_column + cols[None, :]
    w = tl.load(tile, mask=live[:, None], other=0.0)
    d = tl.load(divisor_ptr + expert * rows + row, mask=live, other=1.0)
    u_base = upper_ptr + expert * upper_stride_e + upper_column
    code_base = codes_ptr + expert * codes_stride_e + row * codes_stride_r + codes_column
    error_base = errors_ptr + expert * batch_stride_e + row * batch_stride_r + block_column
    for j in tl.static_range(16):
        column = tl.sum(tl.where(cols[None, :] == j, w, 0.0), axis=1)
        x = (column / d.to(tl.float64)).to(tl.float32)
        a = tl.abs(x)
        index = ((a > _B0).to(tl.int32) + (a > _B1).to(tl.int32) + (a > _B2).to(tl.int32) + (a > _B3).to(tl.int32)
                 + (a > _B4).to(tl.int32) + (a > _B5).to(tl.int32) + (a > _B6).to(tl.int32))
        negative = x < 0.0
        magnitude = _e2m1_value(index) * d
        q = tl.where(negative, -magnitude, magnitude).to(tl.float64)
        u_row = tl.load(u_base + j * upper_stride_r + cols)  # U[e, column + j, column:column + 16]
        pivot = tl.sum(tl.where(cols == j, u_row, 0.0), axis=0)
        error = (column - q) / pivot
        tl.store(code_base + j, (index | (negative.to(tl.int32) << 3)).to(tl.uint8), mask=live)
        tl.store(error_base + j, error, mask=live)
        update = error[:, None] * u_row[None, :]
        w = tl.where(cols[None, :] > j, w - update, w)


def gptq_block_columns(
    batch: torch.Tensor, block_start: int, divisor: torch.Tensor, upper: torch.Tensor, column: int,
    codes: torch.Tensor, errors: torch.Tensor,
) -> None:
    """The column steps of one block (see `gptq_solver._block_columns_reference`, which this equals bit for bit).

    :param batch: float64 `[E, R, W]` (the lazy batch; its block columns `block_start:block_start+16` are read).
    :param divisor: fp32 `[E, R]`, the block's scale per row (`e4m3 * weight_scale_2`).
    :param upper: float64 `[E, in, in]`, the inverse-Hessian factor; `column` is the block's first input column.
    :param codes: uint8 `[E, R, in]`, written at the block's columns; :param errors: float64 `[E, R, W]`, written at
        `block_start:block_start+16`.
    """
    experts, rows, _ = batch.shape
    for name, t in (("batch", batch), ("upper", upper), ("codes", codes), ("errors", errors)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have unit stride in its last dimension")
    if errors.stride() != batch.stride():
        raise ValueError("errors must be laid out as batch")
    divisor = divisor.contiguous()
    grid = (triton.cdiv(rows, _ROWS_PER_PROGRAM), experts)
    _gptq_block_kernel[grid](
        batch, divisor, upper, codes, errors,
        rows, batch.stride(0), batch.stride(1), upper.stride(0), upper.stride(1), codes.stride(0), codes.stride(1),
        block_start, column * upper.stride(1) + column, column,
        ROWS=_ROWS_PER_PROGRAM, **_COMPILE,
    )


assert NVFP4_BLOCK_SIZE == 16  # the kernel's tile width
