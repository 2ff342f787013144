"""`RequantizeOptions`: requantize's options, read by `kimi-nvfp4 requantize`, `[requantize]` in pipeline.toml and
`requantize_checkpoint` (kimi_nvfp4/stage_options.py)."""

from __future__ import annotations

from enum import Enum
from typing import Annotated, Any, ClassVar

from pydantic import BaseModel, Field, ValidationInfo, field_validator

from ..calibrate.expert_stats import STATS_MODES_FOR, expert_stats_mode_for
from ..numerics.methods import ScaleMethod, StatisticsNeed, method_spec
from ..numerics.methods.output_aware.refine import BATCH_EXPERTS
from ..stage_kit.device_type import Device
from ..stage_kit.method_option import MethodOptions, checked_method_options, method_options_field, typed_method_options
from ..stage_options import Cli, StageOptions

# The output-aware methods (those that need calibration statistics), in the registry's order.
OUTPUT_AWARE_METHODS = tuple(m.value for m in ScaleMethod if method_spec(m).statistics is not StatisticsNeed.NONE)
DEFAULT_REQUANTIZE_METHOD = "gptq"

OutputAwareMethod = Enum(
    "OutputAwareMethod", {n.upper().replace("-", "_"): n for n in OUTPUT_AWARE_METHODS}, type=str
)
OutputAwareMethod.__doc__ = "Scale methods that need calibration statistics ('act-diag', 'gptq', 'gptq-w4a4', ...)."

__all__ = ["OUTPUT_AWARE_METHODS", "STATS_MODES_FOR", "OutputAwareMethod", "RequantizeOptions", "expert_stats_mode_for"]


class RequantizeOptions(StageOptions):
    method: OutputAwareMethod = Field(
        OutputAwareMethod(DEFAULT_REQUANTIZE_METHOD), description="Output-aware scale method for the routed experts (act-diag needs "
                                               "calibrate --expert-stats diag or hessian, gptq needs hessian, "
                                               "gptq-w4a4 and gptq-w4a4-diag need w4a4).")
    method_options: MethodOptions = method_options_field(OUTPUT_AWARE_METHODS)
    device: Device = Field("auto", description="auto, cpu, cuda or cuda:N (where the methods run).")
    batch_experts: int = Field(BATCH_EXPERTS, ge=1, description="Experts refined together (GPTQ batches them).")
    recalibrate: Annotated[bool, Cli("--recalibrate/--no-recalibrate")] = Field(
        True, description="Re-run calibration with its recorded settings afterwards, so the input scales are those "
                          "of the requantized weights (docs/requantize.md says why they change).")

    # What decides the rewritten shards' bytes (with the statistics files, recorded per shard), besides the
    # method's whole options (`method_options`, recorded over their defaults).
    RECORDED: ClassVar[tuple[str, ...]] = ("method", "recalibrate")

    @field_validator("method_options")
    @classmethod
    def _typed_method_options(cls, value: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        method = info.data.get("method")
        return value if method is None else checked_method_options(method.value, value)

    def method_config(self) -> BaseModel:
        """The method's whole typed options (`method_options` over its defaults)."""
        return typed_method_options(self.method.value, self.method_options)

    def recorded(self) -> dict[str, Any]:
        return {**self.model_dump(mode="json", include=set(self.RECORDED)),
                "method_options": self.method_config().model_dump(mode="json")}
