"""Batch-invariant products: a token's result does not depend on which other tokens share its matmul.

Calibrate's input scales are maxima of activations, and a maximum is exact under any reduction order, but the
activations themselves come out of GEMMs, and BLAS libraries choose their blocking, their kernel and their
thread split from the matrix shape: the same token multiplied inside a 37-row and inside a 1,000-row matrix can
differ in the last bits (MKL's sgemm does, measured), and so can a 2-thread and a 1-thread product once the
reduction is long enough for MKL to split it over threads (K >= 1024 in fp32, K >= 2048 in bf16 on the
Sapphire Rapids CI machines; K <= 640 never differed). How the work is cut -- ranks, chunk size, expert batch,
memory plan, resume point, threads -- would then reach the checkpoint's bytes.

So every product of the layer-streamed model that mixes tokens runs here, over FIXED-SHAPE tiles:
- rows are cut into tiles of exactly `row_tile(device)` rows, the last one zero-padded: every GEMM the BLAS sees
  has the same shape whatever the batch, so it takes the same kernel, and a row's result does not depend on its
  position inside the tile (tests/model/test_batch_invariant.py holds the primitive to that, rows at every
  position, batches of 1 to 1,000 rows, 1 and 2 threads);
- on CPU the reduction is cut into `CPU_REDUCTION_CHUNK` columns (short enough that no thread split happens),
  each chunk's product in fp32 and the chunks added in order in fp32, then rounded once to the compute dtype:
  the arithmetic of a tensor-core GEMM (bf16 products exact in fp32, fp32 accumulation), in a fixed order.
- on CUDA, half-precision products run as one Triton launch (numerics/grouped_matmul_kernel.py) whose programs
  each compute a fixed-size output tile with a fixed K loop: invariant by construction, and one launch for all of a
  MoE chunk's experts (`linear_row_spans`) instead of one cuBLAS call per 256-row tile. fp32 products (and a build
  without Triton) keep the fixed-shape tiles, each one cuBLAS call of a fixed shape (cuBLAS picks its kernel, split-K
  included, from the shape, and is deterministic for a given shape on a given GPU type).

Elementwise functions are not invariant on CPU either: ATen's vectorized loops run whole SIMD blocks through
Sleef and the remainder of a call's range (and of each thread's share above its 32,768-element grain) through
the scalar libm function, which rounds differently (`sigmoid` and `silu` differ for ~1 token in 10 at the demo's
16 experts, measured). `pointwise_rows` runs such a function over row tiles whose element count is a multiple of
the widest unrolled SIMD block and below the grain: one thread, no remainder, every element through the same code.
CUDA's elementwise kernels compute every element with the same instructions.

Cost: measured by `bench/quality/batch_invariance.py` (docs/benchmarks.md, "Batch invariance").
`BATCH_INVARIANT = False` restores plain `F.linear` everywhere (benchmarks compare the two).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from ..numerics.triton_support import triton_module

BATCH_INVARIANT = True

# Rows per GEMM on CPU: MKL's throughput at 64 rows is within ~2x of one large GEMM (docs/benchmarks.md), while
# an expert's last, zero-padded tile wastes at most 63 rows.
CPU_ROW_TILE = 64
# Rows per GEMM on CUDA: large enough that one tile of a K2.6 expert ([*, 7168] x [7168, 2048]) fills the H200
# with thread blocks; an expert's padded tile wastes at most this many rows of ~1.4k per chunk.
CUDA_ROW_TILE = 256
# Reduction columns per CPU GEMM: no MKL thread split below 1024 columns in fp32 (measured, see above).
CPU_REDUCTION_CHUNK = 512


# Elements per CPU pointwise call: below ATen's parallel grain (at::internal::GRAIN_SIZE = 32768, one thread), and
# rows padded to a multiple of POINTWISE_COLUMN_MULTIPLE (2 x 512-bit vectors of fp32 = 32, of bf16 = 64) so no
# element falls into a scalar remainder.
POINTWISE_TILE_ELEMENTS = 32768
POINTWISE_COLUMN_MULTIPLE = 64


def row_tile(device: torch.device) -> int:
    return CUDA_ROW_TILE if device.type == "cuda" else CPU_ROW_TILE


def linear_rows(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ weight.T` for `x [M, K]`, `weight [N, K]`, each row computed as if it were alone in its batch.

    `out`: an `[M, N]` tensor (a view is fine) to write into; the result is returned either way.
    """
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"linear_rows: x {tuple(x.shape)} and weight {tuple(weight.shape)} do not multiply")
    rows, n_out = x.shape[0], weight.shape[0]
    if not BATCH_INVARIANT:
        if out is None:
            return F.linear(x, weight)
        torch.mm(x, weight.t(), out=out)
        return out
    if out is None:
        out = x.new_empty(rows, n_out)
    if rows == 0:
        return out
    kernel = _span_kernel(x, weight)
    if kernel is not None:
        target = out if out.stride(1) == 1 else torch.empty_like(out, memory_format=torch.contiguous_format)
        kernel.grouped_matmul(_rows_contiguous(x), [(0, rows)], [_rows_contiguous(weight)], target)
        if target is not out:
            out.copy_(target)
        return out
    tile = row_tile(x.device)
    tile_product = _cuda_tile_product if x.device.type == "cuda" else _cpu_tile_product(weight)
    whole = rows - rows % tile
    for start in range(0, whole, tile):
        tile_product(x[start : start + tile], weight, out[start : start + tile])
    if whole < rows:
        padded = x.new_zeros(tile, x.shape[1])
        padded[: rows - whole] = x[whole:]
        result = x.new_empty(tile, n_out)
        tile_product(padded, weight, result)
        out[whole:] = result[: rows - whole]
    return out


def linear_row_spans(x: torch.Tensor, spans: Sequence[tuple[int, int]], weights: Sequence[torch.Tensor],
                     out: torch.Tensor) -> torch.Tensor:
    """`out[a:b] = x[a:b] @ w.T` for each span `(a, b)` and its weight `w` (a MoE chunk's expert-sorted rows), each
    row as `linear_rows` computes it; on CUDA in half precision, one launch for all spans."""
    kernel = _span_kernel(x, weights[0]) if weights and BATCH_INVARIANT else None
    if kernel is not None and out.stride(1) == 1 and all(w.dtype == x.dtype for w in weights):
        return kernel.grouped_matmul(_rows_contiguous(x), spans, [_rows_contiguous(w) for w in weights], out)
    for (a, b), w in zip(spans, weights):
        linear_rows(x[a:b], w, out=out[a:b])
    return out


def _span_kernel(x: torch.Tensor, weight: torch.Tensor):
    """numerics/grouped_matmul_kernel.py where it serves this product (CUDA, half precision, Triton), else None.
    The choice depends on the device and dtypes only, never on the rows: a row takes one path whatever its batch."""
    if x.device.type != "cuda" or x.dtype != weight.dtype:
        return None
    kernel = triton_module("grouped_matmul_kernel")
    return kernel if kernel is not None and x.dtype in kernel.SUPPORTED_DTYPES else None


def _rows_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _cuda_tile_product(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> None:
    torch.mm(x, weight.t(), out=out)


def _cpu_tile_product(weight: torch.Tensor):
    """The per-tile product for one weight on CPU, its reduction chunks (in fp32) prepared once."""
    n_in = weight.shape[1]
    if n_in <= CPU_REDUCTION_CHUNK and weight.dtype == torch.float32:
        def single(x: torch.Tensor, _w: torch.Tensor, out: torch.Tensor) -> None:
            torch.mm(x, weight.t(), out=out)

        return single
    spans = [(a, min(a + CPU_REDUCTION_CHUNK, n_in)) for a in range(0, n_in, CPU_REDUCTION_CHUNK)]
    chunks = [weight[:, a:b].to(torch.float32).t() for a, b in spans]

    def chunked(x: torch.Tensor, _w: torch.Tensor, out: torch.Tensor) -> None:
        xf = x.to(torch.float32)
        acc = torch.mm(xf[:, spans[0][0] : spans[0][1]], chunks[0])
        for (a, b), w_chunk in zip(spans[1:], chunks[1:]):
            acc.add_(torch.mm(xf[:, a:b], w_chunk))
        out.copy_(acc)

    return chunked


def batched_rows(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`a @ b` for `a [B, M, K]`, `b [B, K, N]` (attention's per-head products) with the reduction cut as in
    `linear_rows` on CPU, so that a thread split never changes a row; `M` is fixed by the caller (attention's
    query blocks depend only on the sequence). On CUDA, `torch.bmm`."""
    plain = a.shape[-1] <= CPU_REDUCTION_CHUNK and a.dtype == b.dtype == torch.float32
    if a.device.type == "cuda" or not BATCH_INVARIANT or plain:
        return torch.bmm(a, b)
    n_in = a.shape[-1]
    acc = None
    for start in range(0, n_in, CPU_REDUCTION_CHUNK):
        end = min(start + CPU_REDUCTION_CHUNK, n_in)
        part = torch.bmm(a[..., start:end].to(torch.float32), b[:, start:end].to(torch.float32))
        acc = part if acc is None else acc.add_(part)
    return acc.to(a.dtype)


def pointwise_rows(fn: Callable[..., torch.Tensor], *rows: torch.Tensor) -> torch.Tensor:
    """`fn(*rows)` for same-shape `[M, C]` tensors and an elementwise `fn`, each element computed by the same code
    whatever `M` and wherever its row sits (see the module docstring). On CUDA (or with BATCH_INVARIANT off),
    `fn(*rows)`."""
    first = rows[0]
    if first.device.type == "cuda" or not BATCH_INVARIANT or first.numel() == 0:
        return fn(*rows)
    n_rows, cols = first.shape
    width = -(-cols // POINTWISE_COLUMN_MULTIPLE) * POINTWISE_COLUMN_MULTIPLE
    tile = max(1, POINTWISE_TILE_ELEMENTS // width)
    out = None
    buffers = [r.new_zeros(tile, width) for r in rows]
    for start in range(0, n_rows, tile):
        end = min(start + tile, n_rows)
        for buf, r in zip(buffers, rows):
            buf[: end - start, :cols] = r[start:end]
            if end - start < tile:
                buf[end - start :].zero_()
        y = fn(*buffers)
        if out is None:
            out = y.new_empty(n_rows, cols)
        out[start:end] = y[: end - start, :cols]
    return out
