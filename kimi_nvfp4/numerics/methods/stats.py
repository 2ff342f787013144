"""Error of an NVFP4 matrix against the exact INT4 values it was converted from."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from ..constants import INT4_GROUP_SIZE
from ..nvfp4 import NVFP4Tensor, dequantize_nvfp4
from .types import Int4Matrix

__all__ = ["MatrixErrorStats", "error_stats"]

# Rows per step: bounds the float32 temporaries for a [7168, 2048] matrix to a few MB.
_STATS_ROW_CHUNK = 1024


@dataclass
class MatrixErrorStats:
    """Per converted matrix; recorded in the conversion manifest's `tensor_stats`."""

    rel_mse: float  # sum of squared error / sum of squares of the INT4 values
    exact_fraction: float  # fraction of elements reproduced exactly
    max_abs_error: float
    numel: int
    sum_squared_error: float = 0.0  # kept so that stats of many matrices can be pooled exactly
    sum_squares: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> MatrixErrorStats:
        return cls(**data)

    @classmethod
    def pooled(cls, stats: list[MatrixErrorStats]) -> MatrixErrorStats:
        """Stats of the concatenation of several matrices."""
        numel = sum(s.numel for s in stats)
        sse = sum(s.sum_squared_error for s in stats)
        ss = sum(s.sum_squares for s in stats)
        exact = sum(s.exact_fraction * s.numel for s in stats)
        return cls(
            rel_mse=sse / ss if ss > 0 else 0.0,
            exact_fraction=exact / numel if numel else 1.0,
            max_abs_error=max((s.max_abs_error for s in stats), default=0.0),
            numel=numel,
            sum_squared_error=sse,
            sum_squares=ss,
        )


def _sum_squares(m: Int4Matrix) -> torch.Tensor:
    """sum((q * s)**2) as float64 0-d, per group as s**2 * sum(q**2): every group's term is exact in
    float64 (a bf16 scale squared has 16 significant bits, sum(q**2) <= 32 * 64), and the integer
    pass over int8 codes is cheaper than squaring fp32 values."""
    rows, in_features = m.codes.shape
    groups = m.codes.reshape(rows, in_features // INT4_GROUP_SIZE, INT4_GROUP_SIZE).to(torch.int16)
    code_squares = groups.square().sum(dim=-1, dtype=torch.int32).to(torch.float64)
    return (m.group_scale.to(torch.float64).square() * code_squares).sum()


def error_stats(m: Int4Matrix, q: NVFP4Tensor) -> MatrixErrorStats:
    """Compare `q` (dequantized as Model Optimizer does) with the exact values of `m`.

    Sums of squares are float64 (`vector_norm(..., dtype=float64)` widens each fp32 element before
    squaring, so no square is rounded); the per-chunk partial results stay on the matrix's device and
    are read back once, so a CUDA conversion synchronises once per matrix, not per chunk.
    """
    if tuple(q.shape) != tuple(m.shape):
        raise ValueError(f"NVFP4 shape {q.shape} does not match INT4 shape {m.shape}")
    numel = m.codes.numel()
    if numel == 0:
        return MatrixErrorStats(rel_mse=0.0, exact_fraction=1.0, max_abs_error=0.0, numel=0)
    q = q.to(m.device)
    norms = []  # per chunk: ||diff||_2, ||ref||_2 (float64), nonzero diffs, max |diff|
    rows = m.shape[0]
    for start in range(0, rows, _STATS_ROW_CHUNK):
        stop = min(rows, start + _STATS_ROW_CHUNK)
        chunk = m.rows(start, stop)
        ref = chunk.values()
        part = NVFP4Tensor(q.weight[start:stop], q.weight_scale[start:stop], q.weight_scale_2)
        diff = dequantize_nvfp4(part) - ref
        lowest, highest = torch.aminmax(diff)  # max |diff| without an |diff| temporary
        norms.append(
            torch.stack(
                [
                    torch.linalg.vector_norm(diff, dtype=torch.float64),
                    _sum_squares(chunk),
                    torch.count_nonzero(diff).to(torch.float64),
                    torch.maximum(-lowest, highest).to(torch.float64),
                ]
            )
        )
    per_chunk = torch.stack(norms).cpu().tolist()  # the one device sync
    sse = sum(d * d for d, _, _, _ in per_chunk)
    ss = sum(r for _, r, _, _ in per_chunk)
    inexact = sum(int(n) for _, _, n, _ in per_chunk)
    return MatrixErrorStats(
        rel_mse=sse / ss if ss > 0 else 0.0,
        exact_fraction=(numel - inexact) / numel,
        max_abs_error=max(a for _, _, _, a in per_chunk),
        numel=numel,
        sum_squared_error=sse,
        sum_squares=ss,
    )
