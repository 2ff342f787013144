"""Row-span products `out[a:b] = x[a:b] @ W_i^T` for many spans and weights in ONE launch, batch-invariant by
construction (the CUDA path of `model/batch_invariant.py`).

The layer-streamed model needs every row's product to be the same whatever other rows share its GEMM
(batch_invariant.py says why). With cuBLAS that meant fixed 256-row tiles, one `torch.mm` each: a chunk of 65,536
tokens through 384 routed experts is ~7,800 launches, and the H200 waited on Python between them (a K2.6 MoE chunk
took 0.31-0.58 s invariant against 0.15-0.29 s with plain products, `bench/profile/moe_chunk.py`). Here one program
computes one `BLOCK_M x BLOCK_N` output tile of one span with a K loop of fixed `BLOCK_K` steps from zero, fp32
accumulation, one rounding to the output dtype: a row's result depends on its own inputs and the weight only, never
on the span's length, the row's place in its tile or the other spans (no split-K, no autotuning by shape: the
configuration is a constant). The grid walks spans in order, each span's row tiles in order, the column tiles of one
row tile next to each other, so a row tile is read from L2 while its columns are computed.

Not bit-identical to cuBLAS (another kernel, another order inside each K step); identical across batches, chunks,
ranks and runs on one GPU type, which is what the stages need. fp32 inputs are not taken here (tl.dot would round
them to TF32): batch_invariant.py `_span_kernel` sends only SUPPORTED_DTYPES.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

__all__ = ["SUPPORTED_DTYPES", "grouped_matmul"]

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)
# One configuration for every shape (see the module docstring: a shape-dependent choice would make a row's bits
# depend on the batch). 128 x 128 tiles over 64-deep K steps keep Hopper's tensor cores busy at K2.6's expert and
# attention shapes; 4 stages of (128 x 64 + 64 x 128) bf16 tiles are 128 KiB of shared memory.
_BLOCK_M, _BLOCK_N, _BLOCK_K = 128, 128, 64
_LAUNCH = {"num_warps": 8, "num_stages": 4}
_WEIGHT_ALIGNMENT = 16  # bytes: the `tl.multiple_of` hint on the weight pointers


@triton.jit
def _span_matmul(x_ptr, out_ptr, weight_ptrs, tile_span, tile_row, span_end, n_out, k_in,
                 stride_x, stride_out, stride_w, N_TILES: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    m_tile = pid // N_TILES
    n_tile = pid % N_TILES
    span = tl.load(tile_span + m_tile)
    row0 = tl.load(tile_row + m_tile)
    end = tl.load(span_end + span)
    w_ptr = tl.multiple_of(tl.load(weight_ptrs + span).to(tl.pointer_type(x_ptr.dtype.element_ty)), 16)
    rows = row0 + tl.arange(0, BLOCK_M)
    cols = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < end
    col_ok = cols < n_out
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k_in, BLOCK_K):
        k = k0 + ks
        k_ok = k < k_in
        a = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_x + k[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_ptr + cols[None, :].to(tl.int64) * stride_w + k[:, None],
                    mask=col_ok[None, :] & k_ok[:, None], other=0.0)
        acc = tl.dot(a, b, acc)
    out = out_ptr + rows[:, None].to(tl.int64) * stride_out + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def grouped_matmul(x: torch.Tensor, spans: Sequence[tuple[int, int]], weights: Sequence[torch.Tensor],
                   out: torch.Tensor) -> torch.Tensor:
    """`out[a:b] = x[a:b] @ w.T` for each `(a, b)` of `spans` and `w` of `weights` (all `[N, K]`, one dtype and row
    stride), in one launch; rows outside the spans are not written. `x [M, K]`, `out [M, N]`: rows contiguous."""
    if len(spans) != len(weights):
        raise ValueError(f"grouped_matmul: {len(spans)} spans for {len(weights)} weights")
    # the kernel tells the compiler each weight starts on a 16-byte boundary (vectorized, pipelined loads); a
    # view at an odd offset is copied first
    live = [(a, b, w if w.data_ptr() % _WEIGHT_ALIGNMENT == 0 else w.clone())
            for (a, b), w in zip(spans, weights) if b > a]
    if not live:
        return out
    n_out, k_in = live[0][2].shape
    stride_w = live[0][2].stride(0)
    for _, _, w in live:
        if tuple(w.shape) != (n_out, k_in) or w.stride(0) != stride_w or w.dtype != x.dtype or w.stride(1) != 1:
            raise ValueError("grouped_matmul: every weight must have one shape, row stride and the input's dtype")
    if x.shape[1] != k_in or out.shape[1] != n_out or out.stride(1) != 1 or x.stride(1) != 1:
        raise ValueError(f"grouped_matmul: x {tuple(x.shape)}, out {tuple(out.shape)} and weights {(n_out, k_in)}")
    tile_span, tile_row = [], []
    for i, (a, b, _) in enumerate(live):
        starts = range(a, b, _BLOCK_M)
        tile_span += [i] * len(starts)
        tile_row += list(starts)
    device = x.device
    table = torch.tensor([tile_span, tile_row], dtype=torch.int32).to(device, non_blocking=True)
    ends = torch.tensor([b for _, b, _ in live], dtype=torch.int32).to(device, non_blocking=True)
    pointers = torch.tensor([w.data_ptr() for _, _, w in live], dtype=torch.int64).to(device, non_blocking=True)
    n_tiles = triton.cdiv(n_out, _BLOCK_N)
    grid = (len(tile_row) * n_tiles,)
    _span_matmul[grid](x, out, pointers, table[0], table[1], ends, n_out, k_in, x.stride(0), out.stride(0), stride_w,
                       N_TILES=n_tiles, BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N, BLOCK_K=_BLOCK_K, **_LAUNCH)
    return out
