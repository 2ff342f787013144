"""Output-aware requantization of experts with a registered method that needs calibration statistics.

`convert` writes the weight-only (int4-aware) result; after calibration has recorded each expert's input
statistics, `requantize_experts` re-chooses the experts' NVFP4 scales and codes against the INT4 model's outputs
(`output_aware/refine.py`: statistics fallback, batching, never worse than int4-aware per matrix).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import BaseModel

from .output_aware.refine import BATCH_EXPERTS, ExpertMatrices, RefineSummary, refine_experts
from .registry import ScaleMethod, method_spec

__all__ = ["requantize_experts"]


def requantize_experts(
    method: ScaleMethod | str, experts: Sequence[ExpertMatrices], *, batch_experts: int = BATCH_EXPERTS,
    options: Mapping[str, Any] | BaseModel | None = None,
) -> RefineSummary:
    """Each expert's NVFP4 tensors by `method` (an output-aware registered method), with the statistics used and the
    weighted output errors per matrix; results on the matrices' device.

    :param experts: per expert, the matrices reading one input (gate+up together, down alone) and its statistics.
    :param options: the method's options (its `options_model`, or a mapping of them); default its defaults.
    """
    spec = method_spec(method)
    if spec.refine is None:
        raise ValueError(f"scale method {spec.name!r} needs no statistics: convert runs it")
    typed = spec.parse_options(options)
    if experts and experts[0].matrices:
        spec.notice_path(experts[0].matrices[0].device)
    refine = functools.partial(spec.refine, options=typed)
    return refine_experts(spec.search, refine, experts, dense=spec.statistics.dense, batch_experts=batch_experts)
