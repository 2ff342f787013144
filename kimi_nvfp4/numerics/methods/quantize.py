"""INT4 matrices -> NVFP4 tensors with a registered weight-only scale method (what `convert` runs).

Matrices passed together as a group share one weight_scale_2: SGLang keeps only gate's (w1) scale for the fused
gate/up (w13) weight of an expert (srt/layers/quantization/modelopt_quant.py,
ModelOptNvFp4FusedMoEMethod.process_weights_after_loading), so convert passes gate and up together.

The converter hands a GPU a batch of groups at a time; on CUDA nothing is read back until the caller reads the
`GroupBatch` (every decision, the group fallback included, stays on the device), so the GPU never waits for
Python. The execution path is chosen per group by `search.group.choose_path` (one place; all paths give the same
bytes).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..nvfp4 import NVFP4Tensor
from .int4_matrix import Int4Matrix
from .registry import DEFAULT_METHOD, ScaleMethod, StatisticsNeed, method_spec
from .search.group import SearchPath, choose_path, quantize_group

__all__ = ["GroupBatch", "quantize_int4_groups", "quantize_int4_matrices"]


@dataclass
class GroupBatch:
    """Results of `quantize_int4_groups`, on the matrices' device, in the order given.

    `tensors[g][i]` is the NVFP4 form of `groups[g][i]`. `checks` is int64 `[M, 2]` per matrix (`_scale_checks`);
    a conversion must refuse the batch if any is non-zero (the tensors of bad input are computed but meaningless).
    `stats` is float64 `[M, 4]` `stats.error_sums` rows when requested.
    """

    tensors: list[list[NVFP4Tensor]]
    checks: torch.Tensor
    stats: torch.Tensor | None


def _scale_checks(m: Int4Matrix) -> torch.Tensor:
    """int64 `[2]`: NaN/Inf group scales and zero/negative ones (a zero scale erases its group)."""
    scale = m.group_scale
    return torch.stack([(~torch.isfinite(scale)).sum(), (scale <= 0).sum()])


def _weight_only(method: ScaleMethod | str):
    spec = method_spec(method)
    if spec.statistics is not StatisticsNeed.NONE:
        raise ValueError(
            f"scale method {spec.name!r} needs calibration statistics ({spec.statistics.value}): convert with a "
            f"weight-only method, calibrate, then requantize the experts with {spec.name!r}"
        )
    return spec


def quantize_int4_groups(
    groups: Sequence[Sequence[Int4Matrix]],
    method: ScaleMethod | str = DEFAULT_METHOD,
    *,
    record_stats: bool = False,
    path: SearchPath | str | None = None,
) -> GroupBatch:
    """Convert each group (its matrices share one weight_scale_2), with input checks and, with `record_stats`,
    `stats.error_sums` of every converted matrix.

    :param groups: scale groups of INT4 matrices, all on one device.
    :param method: a weight-only registered method (`registry.weight_only_methods`).
    :param path: force an execution path (tests, benchmarks); default `choose_path`'s choice per group.
    """
    spec = _weight_only(method)
    search = spec.search
    mats = [m for g in groups for m in g]
    if not mats:
        return GroupBatch([], torch.zeros((0, 2), dtype=torch.int64), None)
    devices = {m.device for m in mats}
    if len(devices) != 1:
        raise ValueError(f"matrices converted together must share a device, got {sorted(map(str, devices))}")
    spec.notice_path(mats[0].device)
    checks = torch.stack([_scale_checks(m) for m in mats])
    tensors, rows = [], []
    for g in groups:
        qs, group_rows = quantize_group(list(g), search, choose_path(g, search, path), record_stats=record_stats)
        tensors.append(qs)
        rows.extend(group_rows)
    return GroupBatch(tensors, checks, torch.stack(rows) if record_stats else None)


def quantize_int4_matrices(
    mats: Sequence[Int4Matrix], method: ScaleMethod | str = DEFAULT_METHOD, *, path: SearchPath | str | None = None
) -> list[NVFP4Tensor]:
    """Convert INT4 matrices that share ONE weight_scale_2 (an expert's gate+up, or a down alone)."""
    if not mats:
        return []
    return quantize_int4_groups([mats], method, path=path).tensors[0]
