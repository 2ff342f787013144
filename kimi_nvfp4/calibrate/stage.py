"""The calibrate stage in the pipeline."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from ..stage_kit.pipeline_stage import (
    DEFAULT_DATA,
    ManifestRecordedStage,
    StageContext,
    StageOutcome,
    key_values,
    local_source,
    scalar_fields,
    section_options,
)
from .api import calibrate_checkpoint
from .expert_stats import expert_stats_mode_for
from .options import CalibrateOptions


class CalibrateSection(CalibrateOptions):
    """[calibrate]: calibrate's options, plus the data to calibrate on."""

    enabled: bool = True
    data: str | None = Field(None, description=f"a --data spec (its kinds: `kimi-nvfp4 data sources`; "
                                               f"default {DEFAULT_DATA})")


class CalibrateStage(ManifestRecordedStage):
    name = "calibrate"
    Section = CalibrateSection

    def data(self, ctx: StageContext) -> str:
        return ctx.config.section(self.name).data or DEFAULT_DATA

    def options(self, ctx: StageContext) -> CalibrateOptions:
        section = ctx.config.section(self.name)
        options = section_options(ctx, section, CalibrateOptions)
        requantize = ctx.config.section("requantize")
        if requantize.enabled and "expert_stats" not in section.model_fields_set:
            # the statistics [requantize]'s method needs (set expert_stats here to record more, e.g. hessian)
            options = options.model_copy(update={"expert_stats": expert_stats_mode_for(requantize.method)})
        return options

    def settings(self, ctx: StageContext) -> dict[str, Any]:
        return {"data": self.data(ctx), **self.options(ctx).recorded()}

    def run(self, ctx: StageContext) -> StageOutcome:
        report = calibrate_checkpoint(ctx.output, local_source(ctx), self.data(ctx), self.options(ctx),
                                      report_dir=ctx.report_dir, progress=ctx.progress)
        return StageOutcome(summary=key_values(sequences=report.sequences, tokens=report.tokens,
                                               input_scales=report.input_scales, seconds=report.seconds),
                            details=scalar_fields(report.model_dump(mode="json")))
