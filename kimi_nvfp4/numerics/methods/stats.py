"""Error of an NVFP4 matrix against the exact INT4 values it was converted from."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from ..constants import INT4_GROUP_SIZE
from ..nvfp4 import NVFP4Tensor, dequantize_nvfp4
from .int4_matrix import Int4Matrix
from .search.cpu_tables import code_bytes, cpu_tables_apply, group_code_squares

__all__ = ["MatrixErrorStats", "error_stats", "error_sums", "stats_from_sums"]

# Elements per step: bounds the float32 temporaries to a few MB on CPU (1024 rows of a [7168, 2048]
# matrix); on CUDA a whole K2.6 expert matrix is one step (each step is ~15 kernel launches). The step also
# fixes the order of the float64 sums (each step's `vector_norm`), so a new value changes recorded stats.
_STATS_STEP_ELEMENTS = {"cpu": 1024 * 2048, "cuda": 8 * 2048 * 7168}
# The CPU fills a step's difference in row steps of this many elements (2 MiB temporaries; 2**17..2**21
# measured, this was fastest); any value gives the same sums.
_CPU_DIFF_STEP_ELEMENTS = 1 << 19


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


def _sum_squares(m: Int4Matrix, source: torch.Tensor | None = None) -> torch.Tensor:
    """sum((q * s)**2) as float64 0-d, per group as s**2 * sum(q**2): every group's term is exact in
    float64 (a bf16 scale squared has 16 significant bits, sum(q**2) <= 32 * 64), and the integer
    pass over int8 codes is cheaper than squaring fp32 values. `source`: the rows' code bytes, when the
    CPU has them (`group_code_squares`: the same integers by lookup)."""
    rows, in_features = m.codes.shape
    if source is not None:
        code_squares = group_code_squares(source).to(torch.float64)
    else:
        groups = m.codes.reshape(rows, in_features // INT4_GROUP_SIZE, INT4_GROUP_SIZE).to(torch.int16)
        code_squares = groups.square().sum(dim=-1, dtype=torch.int32).to(torch.float64)
    return (m.group_scale.to(torch.float64).square() * code_squares).sum()


def _chunk_sums(m: Int4Matrix, q: NVFP4Tensor, wide: torch.Tensor | None) -> list[torch.Tensor]:
    """[sum of squared errors, min error, max error, count of inexact elements] of one step (0-d tensors).

    The CPU (`wide`: a float64 buffer of at least the step's size) builds the difference in row steps whose
    temporaries stay in L2, with the same elementwise ops, and widens it into `wide`: the float64 norm is then
    `vector_norm` over the same values, shape and layout as `vector_norm(diff, dtype=float64)`, which widens
    its input the same way (tested equal), without a fresh 2x-sized temporary per step. Min, max and counts
    are exact, so per-row-step results combine to the step's. The count is a float sum of |sign(diff)|
    (count_nonzero is ~5x slower there): every partial sum is an integer below 2**24, so any order adds
    exactly; sign(NaN) is 0 but count_nonzero counts NaN, so a NaN (aminmax propagates it) falls back.
    """
    if wide is None:
        diff = dequantize_nvfp4(q) - m.values()
        lowest, highest = torch.aminmax(diff)  # max |diff| without an |diff| temporary
        norm = torch.linalg.vector_norm(diff, dtype=torch.float64)
        return [norm * norm, lowest, highest, torch.count_nonzero(diff).to(torch.float64)]
    rows, in_features = m.shape
    wide = wide.view(-1)[: rows * in_features].view(rows, in_features)
    step = max(1, _CPU_DIFF_STEP_ELEMENTS // max(1, in_features))
    extremes, counts = [], []
    for start in range(0, rows, step):
        stop = min(rows, start + step)
        part = NVFP4Tensor(q.weight[start:stop], q.weight_scale[start:stop], q.weight_scale_2)
        diff = dequantize_nvfp4(part) - m.rows(start, stop).values()
        extremes.append(torch.stack(torch.aminmax(diff)))
        counts.append(torch.sgn(diff).abs_().sum())
        wide[start:stop] = diff
    norm = torch.linalg.vector_norm(wide)
    extremes = torch.stack(extremes)
    lowest, highest = extremes[:, 0].amin(), extremes[:, 1].amax()
    if bool(lowest.isnan()) or wide.numel() >= 1 << 24:
        inexact = torch.count_nonzero(wide).to(torch.float64)
    else:
        inexact = torch.stack(counts).to(torch.float64).sum()
    return [norm * norm, lowest, highest, inexact]


def error_sums(m: Int4Matrix, q: NVFP4Tensor) -> torch.Tensor:
    """float64 `[4]` on `m`'s device: sum of squared errors, sum of squares, inexact elements, max |error|.

    Nothing is read back, so a GPU conversion can compute the stats of many matrices and read them all
    at once. Sums of squares are float64 (`vector_norm(..., dtype=float64)` widens each fp32 element
    before squaring, so no square is rounded); chunks are added in order, one at a time, so the totals
    are the same IEEE operations on every device.
    """
    if tuple(q.shape) != tuple(m.shape):
        raise ValueError(f"NVFP4 shape {q.shape} does not match INT4 shape {m.shape}")
    totals = torch.zeros(4, dtype=torch.float64, device=m.device)
    q = q.to(m.device)
    rows = m.shape[0]
    budget = _STATS_STEP_ELEMENTS.get(m.device.type, _STATS_STEP_ELEMENTS["cpu"])
    step = max(1, budget // max(1, m.shape[1]))
    source = code_bytes(m) if cpu_tables_apply(m) else None
    wide = None
    if m.device.type == "cpu":
        wide = torch.empty(min(rows, step) * m.shape[1], dtype=torch.float64)
    for start in range(0, rows, step):
        stop = min(rows, start + step)
        chunk = m.rows(start, stop)
        part = NVFP4Tensor(q.weight[start:stop], q.weight_scale[start:stop], q.weight_scale_2)
        squared_error, lowest, highest, inexact = _chunk_sums(chunk, part, wide)
        squares = _sum_squares(chunk, None if source is None else source[start:stop])
        part = torch.stack([squared_error, squares, inexact, torch.zeros_like(squared_error)])
        totals = totals + part
        totals[3] = torch.maximum(totals[3], torch.maximum(-lowest, highest).to(torch.float64))
    return totals


def stats_from_sums(sums: list[float], numel: int) -> MatrixErrorStats:
    """`MatrixErrorStats` from the four values `error_sums` returns (read back)."""
    if numel == 0:
        return MatrixErrorStats(rel_mse=0.0, exact_fraction=1.0, max_abs_error=0.0, numel=0)
    sse, ss, inexact, max_abs = sums
    return MatrixErrorStats(
        rel_mse=sse / ss if ss > 0 else 0.0,
        exact_fraction=(numel - int(inexact)) / numel,
        max_abs_error=max_abs,
        numel=numel,
        sum_squared_error=sse,
        sum_squares=ss,
    )


def error_stats(m: Int4Matrix, q: NVFP4Tensor) -> MatrixErrorStats:
    """Compare `q` (dequantized as Model Optimizer does) with the exact values of `m` (one device sync)."""
    return stats_from_sums(error_sums(m, q).cpu().tolist(), m.codes.numel())
