"""Convert many scale groups in one call, reading nothing back until the caller wants the bytes.

The converter hands a GPU a batch of experts at a time. Per matrix the work is a few dozen kernels, but
every host read-back (`float(amax)`, a data-dependent `unique`, an `if` on an error total) stalls the
stream until the device drains and then leaves it idle while Python catches up. On CUDA this module
therefore keeps every decision on the device: the power-of-two tensor scale via `frexp`, candidate
errors computed per block (no table of distinct scales, whose size would have to be read back), the
"keep Model Optimizer's result if it is better" fallback as a `torch.where`, and the input checks and
error statistics as small device tensors. The caller reads everything once (`GroupBatch`).

With Triton (it ships with CUDA builds of torch), `amax` and `int4-aware` run as two fused kernels per matrix
(`triton_search`: search, then encode with the error statistics on the way), ~6x the torch path's rate for
`int4-aware` on an H200; without it, or with `KIMI_NVFP4_TRITON=0`, the torch ops below give the same bytes.

On CPU there is nothing to overlap, and the per-matrix path (`quantize_int4_matrices`, with its table of
distinct scales, ~3x faster on CPU) is used instead. Both paths give the same bytes: per-block errors are
the same fp32 operations either way (`ErrorTable` is bit-identical to `candidate_errors`), so the same
candidates win; tests compare the two paths, the kernels with the torch path, and CPU against CUDA.
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
        rows = [None] * len(mats)
    else:
        kernels = _fused_kernels(mats[0].device, method)
        done = [_quantize_group_on_device(list(g), method, kernels, record_stats) for g in groups]
        tensors = [qs for qs, _ in done]
        rows = [row for _, group_rows in done for row in group_rows]
    stats = None
    if record_stats:
        flat = [(m, q) for g, qs in zip(groups, tensors) for m, q in zip(g, qs)]
        stats = torch.stack([error_sums(m, q) if row is None else row for (m, q), row in zip(flat, rows)])
    return GroupBatch(tensors, checks, stats)


def _fused_kernels(device: torch.device, method: ScaleMethod):
    """The Triton kernels module when it serves this call (amax or int4-aware on CUDA with Triton installed), else
    None (the torch path: the same bytes)."""
    if method is ScaleMethod.SWEEP or device.type != "cuda":
        return None
    try:
        from . import triton_search
    except ImportError:  # no Triton (e.g. a CPU-only or ROCm-less install): the torch path gives the same bytes
        return None
    return triton_search if triton_search.enabled() else None


def _quantize_group_on_device(
    mats: list[Int4Matrix], method: ScaleMethod, kernels=None, record_stats: bool = False
) -> tuple[list[NVFP4Tensor], list[torch.Tensor | None]]:
    """`quantize_int4_matrices` for one group without a host read-back, and each matrix's `error_sums` row where
    the kernels computed it on the way (None: the caller computes it)."""
    amax = torch.stack([m.amax() for m in mats]).amax()
    baseline_scale_2 = tensor_scales_from_amax(amax)
    weight_scale_2 = power_of_two_tensor_scale(amax)
    if kernels is not None:
        return _quantize_group_fused(kernels, mats, method, weight_scale_2, baseline_scale_2, record_stats)
    none = [None] * len(mats)
    if method is ScaleMethod.AMAX:
        return _quantize_amax_stacked(mats, baseline_scale_2), none
    searched = [search_block_bits(m, weight_scale_2, method, baseline_scale_2, per_block=True) for m in mats]
    fallback = _fallback_flag(searched)
    scale_2 = torch.where(fallback, baseline_scale_2, weight_scale_2)
    out = []
    for m, (bits, amax_bits, _, _) in zip(mats, searched):
        block_scale = e4m3_from_bits(torch.where(fallback, amax_bits, bits))
        out.append(NVFP4Tensor(_encode_rows(m, block_scale, scale_2), block_scale, scale_2))
    return out, none


def _fallback_flag(searched: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Device bool: the group's summed error under the search exceeds Model Optimizer's, so the group keeps amax's
    result (the CPU path's rule; never observed). Totals are added one matrix at a time, in order, as Python's
    sum does on the CPU."""
    chosen_total = torch.zeros((), dtype=torch.float64, device=searched[0][2].device)
    baseline_total = torch.zeros_like(chosen_total)
    for _, _, chosen_error, baseline_error in searched:
        chosen_total = chosen_total + chosen_error
        baseline_total = baseline_total + baseline_error
    return chosen_total > baseline_total


def _quantize_group_fused(
    kernels, mats: list[Int4Matrix], method: ScaleMethod, weight_scale_2: torch.Tensor,
    baseline_scale_2: torch.Tensor, record_stats: bool,
) -> tuple[list[NVFP4Tensor], list[torch.Tensor | None]]:
    """`_quantize_group_on_device` through the fused Triton kernels (same bytes, see triton_search). `amax` is the
    search kernel without candidates, encoded as a group that "fell back" to Model Optimizer's scales."""
    search = method is ScaleMethod.INT4_AWARE
    searched = [
        kernels.search_blocks(m.codes, m.group_scale, weight_scale_2, baseline_scale_2, search=search) for m in mats
    ]
    if search:
        fallback = _fallback_flag(searched)
    else:
        fallback = torch.ones((), dtype=torch.bool, device=baseline_scale_2.device)
    scale_2 = torch.where(fallback, baseline_scale_2, weight_scale_2)
    out, rows = [], []
    for m, (bits, amax_bits, _, _) in zip(mats, searched):
        packed, final_bits, row = kernels.encode_blocks(
            m.codes, m.group_scale, amax_bits if bits is None else bits, amax_bits, weight_scale_2, baseline_scale_2,
            fallback, stats=record_stats,
        )
        out.append(NVFP4Tensor(packed, e4m3_from_bits(final_bits), scale_2))
        rows.append(row)
    return out, rows
