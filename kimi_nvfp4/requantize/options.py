"""`RequantizeOptions`: requantize's options, read by `kimi-nvfp4 requantize`, `[requantize]` in pipeline.toml and
`requantize_checkpoint` (kimi_nvfp4/stage_options.py)."""

from __future__ import annotations

from enum import Enum
from typing import Annotated, Any, ClassVar

from pydantic import Field, field_validator

from ..calibrate.expert_stats import ExpertStatsMode
from ..numerics.methods import ScaleMethod, StatisticsNeed, method_spec
from ..numerics.methods.output_aware.refine import BATCH_EXPERTS
from ..stage_options import Cli, StageOptions, device_name

# The output-aware methods (those that need calibration statistics), in the registry's order.
OUTPUT_AWARE_METHODS = tuple(m.value for m in ScaleMethod if method_spec(m).statistics is not StatisticsNeed.NONE)
DEFAULT_REQUANTIZE_METHOD = "gptq"
# The calibrate `--expert-stats` each kind of statistics needs: a dense Hessian also carries the diagonal.
STATS_MODES_FOR = {
    StatisticsNeed.DIAGONAL: (ExpertStatsMode.DIAG, ExpertStatsMode.HESSIAN),
    StatisticsNeed.HESSIAN: (ExpertStatsMode.HESSIAN,),
    # the served inputs' moments come from calibrate's W4A4 pass; the other methods' statistics are the W4A16
    # observe pass's, so neither kind stands in for the other
    StatisticsNeed.W4A4_HESSIAN: (ExpertStatsMode.W4A4,),
}

OutputAwareMethod = Enum(
    "OutputAwareMethod", {n.upper().replace("-", "_"): n for n in OUTPUT_AWARE_METHODS}, type=str
)
OutputAwareMethod.__doc__ = "Scale methods that need calibration statistics ('act-diag', 'gptq', 'gptq-w4a4', ...)."


def expert_stats_mode_for(method: str) -> ExpertStatsMode:
    """What calibrate must record for `method` (the least that suffices)."""
    return STATS_MODES_FOR[method_spec(OutputAwareMethod(method).value).statistics][0]


class RequantizeOptions(StageOptions):
    method: OutputAwareMethod = Field(
        OutputAwareMethod(DEFAULT_REQUANTIZE_METHOD), description="Output-aware scale method for the routed experts (act-diag needs "
                                               "calibrate --expert-stats diag or hessian, gptq needs hessian, "
                                               "gptq-w4a4 and gptq-w4a4-diag need w4a4).")
    device: str = Field("auto", description="auto, cpu, cuda or cuda:N (where the methods run).")
    batch_experts: int = Field(BATCH_EXPERTS, ge=1, description="Experts refined together (GPTQ batches them).")
    recalibrate: Annotated[bool, Cli("--recalibrate/--no-recalibrate")] = Field(
        True, description="Re-run calibration with its recorded settings afterwards, so the input scales are those "
                          "of the requantized weights (docs/requantize.md says why they change).")

    # What decides the rewritten shards' bytes (with the statistics files, recorded per shard).
    RECORDED: ClassVar[tuple[str, ...]] = ("method", "recalibrate")

    @field_validator("device", mode="before")
    @classmethod
    def _device_name(cls, value: Any) -> Any:
        return device_name(value)

    def recorded(self) -> dict[str, Any]:
        return self.model_dump(mode="json", include=set(self.RECORDED))
