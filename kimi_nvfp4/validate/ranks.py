"""Combine what each rank of a data-parallel validate measured (kimi_nvfp4.distributed).

Every helper returns the same numbers on every rank: sums are added in rank order in fp64 (equal to a
one-process run up to the order of additions), counts are exact, and per-position KL values are
concatenated in rank order (their percentile and maximum are exact).
"""

from __future__ import annotations

from typing import Hashable, TypeVar

import torch

from ..distributed import RankContext
from .metrics import RelativeError, TokenComparison

K = TypeVar("K", bound=Hashable)


def _sums(err: RelativeError) -> tuple[float, float, int]:
    return err.sum_sq_diff, err.sum_sq_ref, err.count


def relative_error_from_sums(diff: float, ref: float, count: int) -> RelativeError:
    out = RelativeError()
    out._diff, out._ref, out.count = torch.tensor(diff, dtype=torch.float64), torch.tensor(ref, dtype=torch.float64), count
    return out


def merge_relative_errors(ctx: RankContext, errors: dict[K, RelativeError]) -> dict[K, RelativeError]:
    """Per key, the error over every rank's data (keys any rank saw)."""
    if not ctx.distributed:
        return errors
    gathered = ctx.all_gather_object({k: _sums(v) for k, v in errors.items()})
    totals: dict = {}
    for part in gathered:
        for k, (d, r, c) in part.items():
            td, tr, tc = totals.get(k, (0.0, 0.0, 0))
            totals[k] = (td + d, tr + r, tc + c)
    return {k: relative_error_from_sums(*v) for k, v in totals.items()}


def merge_counts(ctx: RankContext, counts: dict[K, int]) -> dict[K, int]:
    if not ctx.distributed:
        return counts
    out: dict = {}
    for part in ctx.all_gather_object(dict(counts)):
        for k, v in part.items():
            out[k] = out.get(k, 0) + v
    return out


def merge_token_comparison(ctx: RankContext, tc: TokenComparison) -> TokenComparison:
    """KL values of every rank's positions, and the summed counts and NLLs."""
    if not ctx.distributed:
        return tc
    parts = ctx.all_gather_object(
        (tc.kl_values, tc.top1_agree, tc.positions, tc.nll_ref, tc.nll_test, tc.scored)
    )
    out = TokenComparison()
    for kl, top1, positions, nll_ref, nll_test, scored in parts:
        if kl.numel():
            out.kl_chunks.append(kl)
        out.top1_agree += top1
        out.positions += positions
        out.nll_ref += nll_ref
        out.nll_test += nll_test
        out.scored += scored
    return out
