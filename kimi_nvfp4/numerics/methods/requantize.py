"""Output-aware requantization of experts with a registered method that needs calibration statistics.

`convert` writes the weight-only (int4-aware) result; after calibration has recorded each expert's input
statistics, `requantize_experts` re-chooses the experts' NVFP4 scales and codes against the INT4 model's outputs
(`output_aware/refine.py`: statistics fallback, batching, never worse than int4-aware per matrix).
"""

from __future__ import annotations

from collections.abc import Sequence

from .output_aware.refine import BATCH_EXPERTS, ExpertMatrices, RefineSummary, refine_experts
from .registry import ScaleMethod, method_spec

__all__ = ["requantize_experts"]


def requantize_experts(
    method: ScaleMethod | str, experts: Sequence[ExpertMatrices], *, batch_experts: int = BATCH_EXPERTS
) -> RefineSummary:
    """Each expert's NVFP4 tensors by `method` (an output-aware registered method), with the statistics used and the
    weighted output errors per matrix; results on the matrices' device.

    :param experts: per expert, the matrices reading one input (gate+up together, down alone) and its statistics.
    """
    spec = method_spec(method)
    if spec.refine is None:
        raise ValueError(f"scale method {spec.name!r} needs no statistics: convert runs it")
    return refine_experts(spec.search, spec.refine, experts, dense=spec.statistics.dense, batch_experts=batch_experts)
