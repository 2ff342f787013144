"""The calibration-weighted output error of a quantized expert matrix against its INT4 weights.

`tr((W - Q) H (W - Q)^T)` with the dense input Hessian H when the statistics hold one, else
`sum_j E[x_j^2] * ||W[:, j] - Q[:, j]||^2` (H's diagonal). W is the exact INT4 matrix (the reference: the INT4
model's output is the target, never BF16 weights) and Q the NVFP4 tensor as it dequantizes. The output-aware
methods are guarded with it: a matrix keeps the weight-error search's result unless the refinement has a
smaller error here.

With statistics of the served (W4A4) inputs (`ExpertInputStats.quantized`), the error is the one the served layer
makes: `E||W x - Q x~||^2 = tr(W H W^T) - 2 tr(W C Q^T) + tr(Q H~ Q^T)` (input_stats.py), or channel by channel
`sum_j (H_jj w_j^2 - 2 C_jj w_j q_j + H~_jj q_j^2)` with the diagonals only (each term is the channel's own
`E(w_j x_j - q_j x~_j)^2`, so never negative).

Determinism: differences are exact in float64 (both operands are fp32); the diagonal form uses only elementwise
float64 operations and fixed-order pairwise sums (`fixed_order_sum`), so it is identical on every device. The
dense form multiplies by H with a matrix product, whose summation order is the BLAS library's (CPU and CUDA may
differ in the last bits).
"""

from __future__ import annotations

import torch

from ...nvfp4 import NVFP4Tensor, dequantize_nvfp4
from ..int4_matrix import Int4Matrix
from .input_stats import ExpertInputStats

__all__ = ["fixed_order_sum", "output_error", "row_output_errors"]

# Rows per step: bounds the float64 temporaries (two [rows, in] and, dense, [rows, in] @ [in, in]).
_ROWS_PER_STEP = 1024


def fixed_order_sum(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Sum over `dim` as a pairwise tree over the length padded with zeros to a power of two: the same IEEE
    additions in the same order on every device (torch's reductions order by their kernel's blocking)."""
    x = x.movedim(dim, -1)
    length = x.shape[-1]
    width = 1 << max(0, (length - 1).bit_length())
    if width != length:
        x = torch.nn.functional.pad(x, (0, width - length))
    while x.shape[-1] > 1:
        x = x[..., 0::2] + x[..., 1::2]
    return x[..., 0]


def row_output_errors(weight: torch.Tensor, dequantized: torch.Tensor, stats: ExpertInputStats) -> torch.Tensor:
    """float64 `[out]`: each output row's weighted squared error (`weight`, `dequantized`: fp32 `[out, in]`)."""
    energy = stats.channel_energy.to(weight.device)
    hessian = None if stats.hessian is None else stats.hessian.to(weight.device)
    if stats.quantized is not None:
        return _served_row_errors(weight, dequantized, stats)
    rows = []
    for start in range(0, weight.shape[0], _ROWS_PER_STEP):
        diff = weight[start : start + _ROWS_PER_STEP].double() - dequantized[start : start + _ROWS_PER_STEP].double()
        if hessian is None:
            rows.append(fixed_order_sum(diff * diff * energy))
        else:
            rows.append(fixed_order_sum((diff @ hessian) * diff))
    return torch.cat(rows) if rows else torch.zeros(0, dtype=torch.float64, device=weight.device)


def _served_row_errors(weight: torch.Tensor, dequantized: torch.Tensor, stats: ExpertInputStats) -> torch.Tensor:
    """float64 `[out]`: each row's expected W4A4 error `E(w.x - q.x~)^2` (module docstring)."""
    q = stats.quantized.to(weight.device)
    rows = []
    if stats.hessian is None:
        energy = stats.channel_energy.to(weight.device)
        for start in range(0, weight.shape[0], _ROWS_PER_STEP):
            w = weight[start : start + _ROWS_PER_STEP].double()
            d = dequantized[start : start + _ROWS_PER_STEP].double()
            rows.append(fixed_order_sum(w * w * energy - 2.0 * w * d * q.cross_energy + d * d * q.energy))
    else:
        hessian = stats.hessian.to(weight.device)
        for start in range(0, weight.shape[0], _ROWS_PER_STEP):
            w = weight[start : start + _ROWS_PER_STEP].double()
            d = dequantized[start : start + _ROWS_PER_STEP].double()
            rows.append(fixed_order_sum((w @ hessian) * w - 2.0 * (w @ q.cross) * d + (d @ q.hessian) * d))
    return torch.cat(rows) if rows else torch.zeros(0, dtype=torch.float64, device=weight.device)


def output_error(m: Int4Matrix, q: NVFP4Tensor, stats: ExpertInputStats) -> torch.Tensor:
    """float64 0-d: the calibration-weighted output error of `q` against the INT4 matrix `m` (module docstring)."""
    if tuple(q.shape) != tuple(m.shape) or stats.in_features != m.shape[1]:
        raise ValueError(f"shapes differ: INT4 {m.shape}, NVFP4 {q.shape}, statistics of width {stats.in_features}")
    return fixed_order_sum(row_output_errors(m.values(), dequantize_nvfp4(q.to(m.device)), stats))
