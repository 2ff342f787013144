"""Convert many scale groups in one call, reading nothing back until the caller wants the bytes.

The converter hands a GPU a batch of experts at a time. Per matrix the work is a few dozen kernels, but
every host read-back (`float(amax)`, a data-dependent `unique`, an `if` on an error total) stalls the
stream until the device drains and then leaves it idle while Python catches up. On CUDA this module
therefore keeps every decision on the device: the power-of-two tensor scale via `frexp`, candidate
errors computed per block (no table of distinct scales, whose size would have to be read back), the
"keep Model Optimizer's result if it is better" fallback as a `torch.where`, and the input checks and
error statistics as small device tensors. The caller reads everything once (`GroupBatch`).

On CPU there is nothing to overlap, and the per-matrix path (`quantize_int4_matrices`, with its table of
distinct scales, ~3x faster on CPU) is used instead. Both paths give the same bytes: per-block errors are
the same fp32 operations either way (`ErrorTable` is bit-identical to `candidate_errors`), so the same
candidates win; tests compare the two paths, and CPU against CUDA.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..e4m3 import e4m3_from_bits
from ..nvfp4 import NVFP4Tensor, tensor_scales_from_amax
from .quantize import (
    DEFAULT_METHOD,
    _encode_rows,
    _quantize_amax_stacked,
    power_of_two_tensor_scale,
    quantize_int4_matrices,
    search_block_bits,
)
from .stats import error_sums
from .types import Int4Matrix, ScaleMethod

__all__ = ["GroupBatch", "quantize_int4_groups", "scale_checks"]


@dataclass
class GroupBatch:
    """Results of `quantize_int4_groups`, on the matrices' device, in the order given.

    `tensors[g][i]` is the NVFP4 form of `groups[g][i]` (None when a check failed on CPU, where
    nothing is computed for bad input). `checks` is int64 `[M, 2]` per matrix (`scale_checks`);
    a conversion must refuse the batch if any is non-zero. `stats` is float64 `[M, 4]` `error_sums` rows
    when requested.
    """

    tensors: list[list[NVFP4Tensor]] | None
    checks: torch.Tensor
    stats: torch.Tensor | None


def scale_checks(m: Int4Matrix) -> torch.Tensor:
    """int64 `[2]`: NaN/Inf group scales and zero/negative ones (a zero scale erases its group)."""
    scale = m.group_scale
    return torch.stack([(~torch.isfinite(scale)).sum(), (scale <= 0).sum()])


def quantize_int4_groups(
    groups: Sequence[Sequence[Int4Matrix]],
    method: ScaleMethod | str = DEFAULT_METHOD,
    *,
    record_stats: bool = False,
    deferred: bool | None = None,
) -> GroupBatch:
    """`quantize_int4_matrices` for each group (each group shares one weight_scale_2), plus input checks
    and, with `record_stats`, `error_sums` of every converted matrix.

    `deferred`: take the no-read-back path (default: on any device but the CPU; tests force it on CPU).
    """
    method = ScaleMethod(method)
    mats = [m for g in groups for m in g]
    if not mats:
        return GroupBatch([], torch.zeros((0, 2), dtype=torch.int64), None)
    devices = {m.device for m in mats}
    if len(devices) != 1:
        raise ValueError(f"matrices converted together must share a device, got {sorted(map(str, devices))}")
    checks = torch.stack([scale_checks(m) for m in mats])
    if deferred is None:
        deferred = mats[0].device.type != "cpu"
    if not deferred:
        if bool(checks.any()):
            return GroupBatch(None, checks, None)
        tensors = [quantize_int4_matrices(list(g), method) for g in groups]
    else:
        tensors = [_quantize_group_on_device(list(g), method) for g in groups]
    stats = None
    if record_stats:
        stats = torch.stack([error_sums(m, q) for g, qs in zip(groups, tensors) for m, q in zip(g, qs)])
    return GroupBatch(tensors, checks, stats)


def _quantize_group_on_device(mats: list[Int4Matrix], method: ScaleMethod) -> list[NVFP4Tensor]:
    """`quantize_int4_matrices` for one group without a host read-back."""
    amax = torch.stack([m.amax() for m in mats]).amax()
    baseline_scale_2 = tensor_scales_from_amax(amax)
    if method is ScaleMethod.AMAX:
        return _quantize_amax_stacked(mats, baseline_scale_2)
    weight_scale_2 = power_of_two_tensor_scale(amax)
    searched = [search_block_bits(m, weight_scale_2, method, baseline_scale_2, per_block=True) for m in mats]
    # Same rule as the CPU path: keep Model Optimizer's result for the whole group if its summed error is
    # smaller (never observed). Totals are added one matrix at a time, in order, as Python's sum does.
    chosen_total = torch.zeros((), dtype=torch.float64, device=amax.device)
    baseline_total = torch.zeros_like(chosen_total)
    for _, _, chosen_error, baseline_error in searched:
        chosen_total = chosen_total + chosen_error
        baseline_total = baseline_total + baseline_error
    fallback = chosen_total > baseline_total
    scale_2 = torch.where(fallback, baseline_scale_2, weight_scale_2)
    out = []
    for m, (bits, amax_bits, _, _) in zip(mats, searched):
        block_scale = e4m3_from_bits(torch.where(fallback, amax_bits, bits))
        out.append(NVFP4Tensor(_encode_rows(m, block_scale, scale_2), block_scale, scale_2))
    return out
