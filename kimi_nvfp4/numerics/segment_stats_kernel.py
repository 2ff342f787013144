"""Calibrate's per-expert input statistics over an expert-sorted buffer, in one Triton kernel per buffer.

The observe pass measures, per routed expert, the input amax (what `input_scale` is made from) and the per-channel
sum of squares of its routed rows. Done expert by expert (`calibrate.stats.ActivationStats.summarize`) that is about
seven kernels per expert input: a K2.6 MoE layer has 384 experts x 2 inputs, so 5,000+ launches per 64k-token chunk
(docs/benchmarks.md §10: the observe pass was the calibrate phase with the most time beyond its GEMMs). The MoE's
sorted path already holds every expert's rows in one buffer, contiguous per expert (`model/moe.py`), so one program
per (expert, 128 channels) walks that expert's rows once.

The numbers are the reference's: each value squared in float32 (as `summarize` does), then added in float64; the
amax is the largest |x| in float32, exact. Only the order of the float64 additions differs, so the sums agree with
the reference to about 1e-15 relative (tests/numerics/test_segment_stats_kernel.py). NaN anywhere in an expert's
rows makes that expert's amax NaN, as `torch.amax` does in the reference (Triton's max does not promise to).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["segment_stats"]

_ROWS = 32
_CHANNELS = 128
_COMPILE = {"enable_fp_fusion": False, "num_warps": 4}


@triton.jit
def _segment_stats_kernel(x_ptr, starts_ptr, ends_ptr, sums_ptr, amax_ptr, width, stride_row,
                          ROWS: tl.constexpr, CHANNELS: tl.constexpr):
    segment = tl.program_id(0)
    cols = tl.program_id(1) * CHANNELS + tl.arange(0, CHANNELS)
    col_live = cols < width
    start = tl.load(starts_ptr + segment)
    end = tl.load(ends_ptr + segment)
    total = tl.zeros([CHANNELS], dtype=tl.float64)
    largest = tl.zeros([CHANNELS], dtype=tl.float32)
    nans = tl.zeros([CHANNELS], dtype=tl.int32)
    for first in range(start, end, ROWS):
        rows = first + tl.arange(0, ROWS)
        live = (rows < end)[:, None] & col_live[None, :]
        offsets = rows.to(tl.int64)[:, None] * stride_row + cols[None, :]
        v = tl.load(x_ptr + offsets, mask=live, other=0.0).to(tl.float32)
        square = v * v  # float32, as the reference squares
        total += tl.sum(square.to(tl.float64), axis=0)
        largest = tl.maximum(largest, tl.max(tl.abs(v), axis=0))
        nans += tl.sum((v != v).to(tl.int32), axis=0)
    largest = tl.where(nans > 0, float("nan"), largest)
    out = segment.to(tl.int64) * width + cols
    tl.store(sums_ptr + out, total, mask=col_live)
    tl.store(amax_ptr + out, largest, mask=col_live)


def segment_stats(rows: torch.Tensor, spans: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per span `(start, end)` of `rows [n, width]` (any float dtype, on CUDA): `amax [spans]` float32 (max |x|)
    and `sum_sq [spans, width]` float64 (sum over the span's rows of x^2, each square in float32)."""
    if rows.dim() != 2:
        raise ValueError(f"expected a [rows, width] buffer, got shape {tuple(rows.shape)}")
    rows = rows if rows.stride(1) == 1 else rows.contiguous()
    width = rows.shape[1]
    sums = torch.zeros(len(spans), width, dtype=torch.float64, device=rows.device)
    channel_amax = torch.zeros(len(spans), width, dtype=torch.float32, device=rows.device)
    if spans and width:
        bounds = torch.tensor(spans, dtype=torch.int64).t().contiguous().to(rows.device)
        grid = (len(spans), triton.cdiv(width, _CHANNELS))
        _segment_stats_kernel[grid](rows, bounds[0], bounds[1], sums, channel_amax, width, rows.stride(0),
                                    ROWS=_ROWS, CHANNELS=_CHANNELS, **_COMPILE)
    return channel_amax.amax(dim=1) if width else channel_amax.sum(dim=1), sums
