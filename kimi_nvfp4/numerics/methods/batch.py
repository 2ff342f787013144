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

from ..constants import NVFP4_BLOCK_SIZE
from ..e4m3 import E4M3_NUM_POSITIVE, e4m3_from_bits
from ..nvfp4 import ZERO_BLOCK_SCALE, NVFP4Tensor, tensor_scales_from_amax
from .block_search import (
    candidate_errors,
    flat_blocks,
    magnitude_histogram_packed,
    select_best,
)
from .candidates import INT4_AWARE_CANDIDATES
from .quantize import (
    _MAGNITUDE_CLASSES,
    _WORK_ELEMENTS,
    DEFAULT_METHOD,
    _candidate_bits,
    _encode_rows,
    _quantize_amax_stacked,
    amax_block_bits,
    power_of_two_tensor_scale,
    quantize_int4_matrices,
)
from .stats import error_sums
from .types import Int4Matrix, ScaleMethod

__all__ = ["CHECK_NAMES", "GroupBatch", "quantize_int4_groups", "scale_checks"]

# Columns of `GroupBatch.checks`, per matrix.
CHECK_NAMES = ("non-finite group scales", "zero or negative group scales")


@dataclass
class GroupBatch:
    """Results of `quantize_int4_groups`, on the matrices' device, in the order given.

    `tensors[g][i]` is the NVFP4 form of `groups[g][i]` (None when a check failed on CPU, where
    nothing is computed for bad input). `checks` is int64 `[M, 2]` counts per matrix (`CHECK_NAMES`);
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
    searched = [_search_on_device(m, weight_scale_2, method, baseline_scale_2) for m in mats]
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


def _search_on_device(
    m: Int4Matrix, weight_scale_2: torch.Tensor, method: ScaleMethod, baseline_scale_2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`search_block_scales` with per-block candidate errors and no read-back.

    Returns the chosen block-scale bits and Model Optimizer's (amax rule under `baseline_scale_2`), both
    uint8 `[out, in/16]`, and the float64 0-d summed errors of each.
    """
    out_features, in_features = m.shape
    blocks_per_row = in_features // NVFP4_BLOCK_SIZE
    candidates = E4M3_NUM_POSITIVE if method is ScaleMethod.SWEEP else INT4_AWARE_CANDIDATES
    work = _WORK_ELEMENTS.get(m.device.type, _WORK_ELEMENTS["cpu"])
    row_chunk = max(1, work // max(1, blocks_per_row * candidates * _MAGNITUDE_CLASSES))
    chosen = torch.empty((out_features * blocks_per_row,), dtype=torch.uint8, device=m.device)
    baseline = torch.empty_like(chosen)
    one = torch.tensor(ZERO_BLOCK_SCALE, dtype=torch.float8_e4m3fn, device=m.device).view(torch.uint8)
    chosen_error = torch.zeros((), dtype=torch.float64, device=m.device)
    baseline_error = torch.zeros_like(chosen_error)
    for start in range(0, out_features, row_chunk):
        stop = min(out_features, start + row_chunk)
        block_codes, block_scale = flat_blocks(m.codes[start:stop], m.group_scale[start:stop])
        histogram = magnitude_histogram_packed(block_codes)
        bits = _candidate_bits(method, block_codes, block_scale, weight_scale_2)
        best, best_error = select_best(candidate_errors(histogram, block_scale, bits, weight_scale_2), bits)
        chosen_error = chosen_error + best_error.double().sum()
        amax_bits = amax_block_bits(block_codes, block_scale, baseline_scale_2)
        amax_error = candidate_errors(histogram, block_scale, amax_bits, baseline_scale_2)
        baseline_error = baseline_error + amax_error.double().sum()
        # An all-zero block is exact under any scale; keep Model Optimizer's 1.0 for it.
        zero = (histogram.sum(dim=0) == 0) | (block_scale == 0)
        chosen[start * blocks_per_row : stop * blocks_per_row] = torch.where(zero, one, best)
        baseline[start * blocks_per_row : stop * blocks_per_row] = amax_bits[0]
    shape = (out_features, blocks_per_row)
    return chosen.reshape(shape), baseline.reshape(shape), chosen_error, baseline_error

