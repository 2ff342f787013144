"""What calibration records at an expert linear's input, for the output-aware scale methods.

An expert linear `y = x W^T` is evaluated on the rows `x` routed to it. Its output error for a quantized `Q` is
`||X (W - Q)^T||^2 / n = tr((W - Q) H (W - Q)^T)` with `H = X^T X / n`, the input Hessian; its diagonal,
`E[x_j^2]` per input channel, gives the diagonal approximation `sum_j E[x_j^2] * ||W[:, j] - Q[:, j]||^2`.
gate and up read the same rows (one `ExpertInputStats` for both); down reads the expert's intermediate.

Calibration produces these with `InputStatsAccumulator` (one per expert linear input, `add(rows)` per batch of
routed rows); nothing here reads a checkpoint.

A dense H estimated from n rows of width p is noisy when n is not much larger than p (its small eigenvalues, the
ones GPTQ inverts, are the noisiest), so dense statistics also keep two fourth moments, from which
`hessian_shrinkage` estimates how far to pull H toward its diagonal (Ledoit and Wolf, "A well-conditioned
estimator for large-dimensional covariance matrices", 2004, with the diagonal target of Schaefer and Strimmer,
2005): lambda = sum_{i != j} Var(H_ij) / sum_{i != j} H_ij**2, with sum_{i != j} Var(H_ij) =
(E||x||^4 - E sum_j x_j^4 - sum_{i != j} H_ij**2) / (n - 1), clamped to [0, 1].

Served (W4A4) inputs: the serving kernel multiplies Q not by x but by x~, x fake-quantized to NVFP4 with the
layer's static input scale. The expected W4A4 output error against the INT4 layer is then

    E||W x - Q x~||^2 = tr(W H W^T) - 2 tr(W C Q^T) + tr(Q H~ Q^T),   H~ = E[x~ x~^T],  C = E[x x~^T]

so statistics for it (`QuantizedInputStats`, `ExpertInputStats.quantized`) keep H~ and C (dense), or their
diagonals E[x~_j^2] and E[x_j x~_j], besides H = E[x x^T] of the same rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["ExpertInputStats", "InputStatsAccumulator", "QuantizedInputStats"]


def _checked_vector(name: str, value: torch.Tensor, width: int) -> torch.Tensor:
    if value.ndim != 1 or value.shape[0] != width or not value.is_floating_point():
        raise ValueError(f"{name} must be a float tensor of shape ({width},), got {tuple(value.shape)}")
    value = value.to(torch.float64)
    if not bool(torch.isfinite(value).all()):
        raise ValueError(f"{name} must be finite")
    return value


def _checked_matrix(name: str, value: torch.Tensor | None, width: int) -> torch.Tensor | None:
    if value is None:
        return None
    if tuple(value.shape) != (width, width) or not value.is_floating_point():
        raise ValueError(f"{name} must be a float tensor of shape {(width, width)}, got {tuple(value.shape)}")
    value = value.to(torch.float64)
    if not bool(torch.isfinite(value).all()):
        raise ValueError(f"{name} must be finite")
    return value


@dataclass
class QuantizedInputStats:
    """What the served layer's inputs look like after the W4A4 activation quantization (module docstring).

    :param energy: float64 `[in]`, mean of `x~_j**2` (the diagonal of H~).
    :param cross_energy: float64 `[in]`, mean of `x_j * x~_j` (the diagonal of C).
    :param hessian: float64 `[in, in]`, `X~^T X~ / n` (H~), or None where only the diagonals were kept.
    :param cross: float64 `[in, in]`, `X^T X~ / n` (C: row i is input channel i of x, column j of x~), or None.
    """

    energy: torch.Tensor
    cross_energy: torch.Tensor
    hessian: torch.Tensor | None = None
    cross: torch.Tensor | None = None

    def __post_init__(self) -> None:
        width = self.energy.shape[0] if self.energy.ndim == 1 else -1
        self.energy = _checked_vector("quantized energy", self.energy, width)
        if bool((self.energy < 0).any()):
            raise ValueError("quantized energy must be non-negative")
        self.cross_energy = _checked_vector("cross energy", self.cross_energy, width)
        self.hessian = _checked_matrix("quantized hessian", self.hessian, width)
        self.cross = _checked_matrix("cross moment", self.cross, width)
        if (self.hessian is None) != (self.cross is None):
            raise ValueError("the quantized hessian and the cross moment are kept together or not at all")

    def diagonal(self) -> QuantizedInputStats:
        return QuantizedInputStats(self.energy, self.cross_energy)

    def to(self, device: torch.device | str) -> QuantizedInputStats:
        def move(t):
            return None if t is None else t.to(device)

        return QuantizedInputStats(self.energy.to(device), self.cross_energy.to(device), move(self.hessian),
                                   move(self.cross))


@dataclass
class ExpertInputStats:
    """Statistics of the rows one expert linear saw in calibration.

    :param tokens: rows seen (routed tokens).
    :param channel_energy: float64 `[in]`, mean of `x_j**2` over the rows.
    :param hessian: float64 `[in, in]`, `X^T X / tokens`, or None where only the diagonal was kept.
    :param mean_norm_fourth: mean of `||x||**4` over the rows (dense statistics; None if not kept).
    :param mean_fourth_power: mean of `sum_j x_j**4` over the rows (as above).
    :param quantized: the same rows' W4A4-quantized statistics (module docstring), or None; dense exactly where
        `hessian` is.
    """

    tokens: int
    channel_energy: torch.Tensor
    hessian: torch.Tensor | None = None
    mean_norm_fourth: float | None = None
    mean_fourth_power: float | None = None
    quantized: QuantizedInputStats | None = None

    def __post_init__(self) -> None:
        if isinstance(self.tokens, bool) or not isinstance(self.tokens, int) or self.tokens < 0:
            raise ValueError(f"ExpertInputStats.tokens must be a non-negative int, got {self.tokens!r}")
        if self.channel_energy.ndim != 1 or not self.channel_energy.is_floating_point():
            raise ValueError(f"channel_energy must be a 1-d float tensor, got {tuple(self.channel_energy.shape)}")
        self.channel_energy = self.channel_energy.to(torch.float64)
        if not bool(torch.isfinite(self.channel_energy).all()) or bool((self.channel_energy < 0).any()):
            raise ValueError("channel_energy must be finite and non-negative")
        if self.hessian is not None:
            expected = (self.in_features, self.in_features)
            if tuple(self.hessian.shape) != expected or not self.hessian.is_floating_point():
                raise ValueError(f"hessian must be a float tensor of shape {expected}, got {tuple(self.hessian.shape)}")
            self.hessian = self.hessian.to(torch.float64)
            if not bool(torch.isfinite(self.hessian).all()):
                raise ValueError("hessian must be finite")
        if self.quantized is not None:
            if self.quantized.energy.shape[0] != self.in_features:
                raise ValueError(f"quantized statistics of width {self.quantized.energy.shape[0]}, "
                                 f"expected {self.in_features}")
            if (self.quantized.hessian is None) != (self.hessian is None):
                raise ValueError("the quantized statistics must be dense exactly where the hessian is")

    @property
    def in_features(self) -> int:
        return self.channel_energy.shape[0]

    def diagonal(self) -> ExpertInputStats:
        """The same statistics without the dense matrices (the quantized diagonals kept)."""
        quantized = None if self.quantized is None else self.quantized.diagonal()
        return ExpertInputStats(self.tokens, self.channel_energy, quantized=quantized)

    def to(self, device: torch.device | str) -> ExpertInputStats:
        hessian = None if self.hessian is None else self.hessian.to(device)
        quantized = None if self.quantized is None else self.quantized.to(device)
        return ExpertInputStats(
            self.tokens, self.channel_energy.to(device), hessian, self.mean_norm_fourth, self.mean_fourth_power,
            quantized,
        )

    def hessian_shrinkage(self) -> float:
        """The weight of diag(H) in the shrunk Hessian `(1 - lambda) H + lambda diag(H)` (module docstring): 0 when
        the fourth moments are unknown (H taken as is), 1 when H's off-diagonal part is indistinguishable from noise."""
        if self.hessian is None or self.mean_norm_fourth is None or self.mean_fourth_power is None or self.tokens < 2:
            return 0.0
        diagonal = self.hessian.diagonal()
        off_diagonal = float(self.hessian.square().sum() - diagonal.square().sum())
        if off_diagonal <= 0:
            return 1.0
        noise = (self.mean_norm_fourth - self.mean_fourth_power - off_diagonal) / (self.tokens - 1)
        return min(1.0, max(0.0, noise / off_diagonal))

    @classmethod
    def pooled(cls, stats: Sequence[ExpertInputStats]) -> ExpertInputStats:
        """Statistics of all the rows together (token-weighted means); dense only if every part is. The
        quantized statistics are not pooled (parts may have been quantized with different input scales)."""
        if not stats:
            raise ValueError("nothing to pool")
        tokens = sum(s.tokens for s in stats)
        weight = [s.tokens / tokens if tokens else 1.0 / len(stats) for s in stats]
        energy = sum(w * s.channel_energy for w, s in zip(weight, stats))
        dense = all(s.hessian is not None for s in stats)
        hessian = sum(w * s.hessian for w, s in zip(weight, stats)) if dense else None
        moments = [None, None]
        if dense and all(s.mean_norm_fourth is not None and s.mean_fourth_power is not None for s in stats):
            moments = [sum(w * s.mean_norm_fourth for w, s in zip(weight, stats)),
                       sum(w * s.mean_fourth_power for w, s in zip(weight, stats))]
        return cls(tokens, energy, hessian, *moments)


# 16-bit rows whose float32 sums live on a GPU: their X^T X is one tensor-core GEMM with float32 accumulation and
# output (`torch.mm(..., out_dtype=float32)`, CUDA only): each product of two bf16 values is exact in float32, so
# this differs from the float32 FFMA GEMM only in the order of the additions, at ~10x its rate (K2.6: ~0.9 PFLOP
# of Hessians per MoE layer at 512 x 2048 calibration tokens).
_TENSOR_CORE_DTYPES = (torch.bfloat16, torch.float16)


def _outer_product_sum(raw: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """`x^T x` for `x`, the rows `raw` cast to the sums' dtype (see _TENSOR_CORE_DTYPES)."""
    if raw.is_cuda and raw.dtype in _TENSOR_CORE_DTYPES and x.dtype == torch.float32:
        try:
            return torch.mm(raw.t(), raw, out_dtype=torch.float32)
        except (TypeError, RuntimeError, NotImplementedError):  # a torch without the out_dtype overload
            pass
    return x.t() @ x


class InputStatsAccumulator:
    """Running sums over the rows one expert linear reads; `stats()` turns them into `ExpertInputStats`.

    :param in_features: width of the rows.
    :param dense: also accumulate `X^T X` (`[in, in]`; 205 MB in float32 for K2.6's 7168-wide gate/up input).
    :param dtype: of the sums (float64 by default; float32 halves the memory of dense sums on a GPU).
    :param quantized: also accumulate the statistics of the rows' W4A4-quantized twins (`add(rows, quantized)`):
        `x~^2` and `x x~` per channel, and dense `X~^T X~` and `X^T X~` (three [in, in] sums in all).
    """

    def __init__(
        self, in_features: int, *, dense: bool, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float64,
        quantized: bool = False,
    ):
        self.tokens = 0
        self.quantized = quantized
        width, square = (in_features,), (in_features, in_features)
        self.sum_quantized_squares = torch.zeros(width, dtype=dtype, device=device) if quantized else None
        self.sum_cross = torch.zeros(width, dtype=dtype, device=device) if quantized else None
        self.sum_quantized_outer = torch.zeros(square, dtype=dtype, device=device) if quantized and dense else None
        self.sum_cross_outer = torch.zeros(square, dtype=dtype, device=device) if quantized and dense else None
        self.sum_squares = torch.zeros(in_features, dtype=dtype, device=device)
        self.sum_outer = torch.zeros((in_features, in_features), dtype=dtype, device=device) if dense else None
        # sum of ||x||**4 and of sum_j x_j**4 (dense only: `ExpertInputStats.hessian_shrinkage`)
        self.sum_fourth = torch.zeros(2, dtype=torch.float64, device=device)

    def add(self, rows: torch.Tensor, quantized_rows: torch.Tensor | None = None) -> None:
        """Add activation rows `[..., in]` (any float dtype; flattened to `[n, in]`) and, for a `quantized`
        accumulator, the same rows as the serving kernel quantizes them (same shape)."""
        if rows.shape[-1] != self.sum_squares.shape[0]:
            raise ValueError(f"rows of width {rows.shape[-1]}, expected {self.sum_squares.shape[0]}")
        if self.quantized != (quantized_rows is not None):
            raise ValueError("a quantized accumulator takes the quantized rows too, any other none")
        x = rows.reshape(-1, rows.shape[-1]).to(device=self.sum_squares.device, dtype=self.sum_squares.dtype)
        if quantized_rows is not None:
            if quantized_rows.shape != rows.shape:
                raise ValueError(f"quantized rows {tuple(quantized_rows.shape)}, rows {tuple(rows.shape)}")
            xq = quantized_rows.reshape(x.shape).to(device=x.device, dtype=x.dtype)
            self.sum_quantized_squares += (xq * xq).sum(dim=0)
            self.sum_cross += (x * xq).sum(dim=0)
            if self.sum_quantized_outer is not None:
                self.sum_quantized_outer += xq.t() @ xq
                self.sum_cross_outer += x.t() @ xq
        self.tokens += x.shape[0]
        squares = x * x
        self.sum_squares += squares.sum(dim=0)
        if self.sum_outer is not None:
            self.sum_outer += _outer_product_sum(rows.reshape(x.shape), x)
            norms = squares.sum(dim=1, dtype=torch.float64)
            self.sum_fourth += torch.stack([norms.square().sum(), squares.double().square().sum()])

    def stats(self) -> ExpertInputStats:
        """The means so far (zero energy and no Hessian before any row)."""
        scale = 1.0 / self.tokens if self.tokens else 0.0
        quantized = None
        if self.quantized:
            dense = self.sum_quantized_outer is not None and self.tokens
            quantized = QuantizedInputStats(
                self.sum_quantized_squares * scale, self.sum_cross * scale,
                self.sum_quantized_outer * scale if dense else None, self.sum_cross_outer * scale if dense else None)
        if self.sum_outer is None or not self.tokens:
            return ExpertInputStats(self.tokens, self.sum_squares * scale, quantized=quantized)
        norm_fourth, fourth_power = (self.sum_fourth * scale).tolist()
        return ExpertInputStats(self.tokens, self.sum_squares * scale, self.sum_outer * scale, norm_fourth,
                                fourth_power, quantized)

    def sums(self) -> list[torch.Tensor]:
        """Every running sum, in a fixed order (what `combine_ranks` adds over ranks)."""
        extra = [self.sum_quantized_squares, self.sum_cross, self.sum_quantized_outer, self.sum_cross_outer]
        return [self.sum_squares, self.sum_fourth, *(t for t in [self.sum_outer, *extra] if t is not None)]
