"""The weights GPTQ aims at when the served layer reads quantized inputs: the Wiener filter `W' = W C H~^-1`.

Under W4A4 the serving kernel computes `Q x~`, x~ the NVFP4 fake-quantized input (static input scale). Against
the INT4 layer `W x` the expected error is (input_stats.py)

    E||W x - Q x~||^2 = tr(Q H~ Q^T) - 2 tr(W C Q^T) + const = ||Q - W'||^2_H~ + const,   W' = W C H~^-1

with H~ = E[x~ x~^T] and C = E[x x~^T]. So GPTQ with Hessian H~ on the target W' minimises the served layer's
error, where plain GPTQ (H = E[x x^T], target W) minimises the W4A16 one. W' is W with each output's linear
least-squares prediction of `W x` from `x~`: a channel whose value is mostly quantization noise (small values
in a 16-block with an outlier, rounded to 0 or one E2M1 step) gets a smaller weight, and its neighbours in
correlated channels take over some of its signal. Diagonal statistics give `W'[:, j] = W[:, j] C_jj / H~_jj`.

Written as `W' = W + W (C - H~) H~^-1` (the same matrix), because the inverse needs damping and only the
correction should be damped: with the solver's dampened `H~ + dI` (`gptq_solver.hessian_factor`: dead
channels get H~_jj = 1, then `damping * mean(diag) * I`, grown tenfold per failed factorisation)

    W' = W + W (C - H~)(H~ + dI)^-1,   so   ||Q - W'||^2_(H~+dI) = tr(Q H~ Q^T) - 2 tr(W C Q^T) + d ||Q - W||^2 + const

the served error plus a ridge term pulling Q toward the INT4 weights. (Damping `W C (H~ + dI)^-1` instead would
pull toward 0: d is 1% of the MEAN channel energy, far above the small channels' own energy where a few outlier
channels dominate the mean, and those channels' weights would be shrunk for nothing: measured, the held-out W4A16
error rose ~8x on heavy-tailed inputs.) Where C = H~ (no activation noise) W' = W exactly. A dead channel
(x~_j always 0, so C and H~ have zero column j) keeps its weight.
"""

from __future__ import annotations

import torch

from .gptq_solver import DAMPING_GROWTH, DAMPING_RETRIES, HESSIAN_DAMPING, dampened_cholesky, live_channel_hessian

__all__ = ["served_target"]


def served_target(
    weight: torch.Tensor, cross: torch.Tensor, quantized_hessian: torch.Tensor, damping: float = HESSIAN_DAMPING,
    *, retries: int = DAMPING_RETRIES, growth: float = DAMPING_GROWTH,
) -> torch.Tensor:
    """float64 `[E, R, in]`: `W + W (C - H~)(H~ + dI)^-1` per expert (module docstring).

    :param weight: float64 `[E, R, in]`, the exact INT4 values.
    :param cross: float64 `[E, in, in]`, C = E[x x~^T] (row i: channel i of x).
    :param quantized_hessian: float64 `[E, in, in]`, H~ = E[x~ x~^T] (undampened, as the solver receives it).
    Experts whose H~ no damping makes positive definite (the solver then runs without error propagation) keep
    W itself as the target.
    """
    h, mean = live_channel_hessian(quantized_hessian)
    # (W (C - H~))^T: right-hand sides for the symmetric system (H~ + dI) X^T = (W (C - H~))^T, W' = W + X
    rhs = torch.bmm(weight, cross - quantized_hessian).transpose(-2, -1)
    target = weight.clone()
    for experts, lower in dampened_cholesky(h, mean, damping, retries=retries, growth=growth):
        target[experts] += torch.cholesky_solve(rhs[experts], lower).transpose(-2, -1)
    return target
