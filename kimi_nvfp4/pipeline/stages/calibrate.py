"""The calibrate stage in the pipeline."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from ...calibrate import CalibrateOptions, calibrate_checkpoint
from ..stage import StageContext, StageOutcome
from .base import DEFAULT_DATA, ManifestRecordedStage, key_values, local_source, scalar_fields, section_options


class CalibrateSection(CalibrateOptions):
    """[calibrate]: calibrate's options, plus the data to calibrate on."""

    enabled: bool = True
    data: str | None = Field(None, description=f"a --data spec: jsonl:PATH, hf:NAME[:SPLIT], tree:PATH, builtin "
                                               f"(default {DEFAULT_DATA})")


class CalibrateStage(ManifestRecordedStage):
    name = "calibrate"
    Section = CalibrateSection

    def data(self, ctx: StageContext) -> str:
        return ctx.config.section(self.name).data or DEFAULT_DATA

    def options(self, ctx: StageContext) -> CalibrateOptions:
        return section_options(ctx, ctx.config.section(self.name), CalibrateOptions)

    def settings(self, ctx: StageContext) -> dict[str, Any]:
        return {"data": self.data(ctx), **self.options(ctx).recorded()}

    def run(self, ctx: StageContext) -> StageOutcome:
        report = calibrate_checkpoint(ctx.output, local_source(ctx), self.data(ctx), self.options(ctx),
                                      report_dir=ctx.report_dir, progress=ctx.progress)
        return StageOutcome(summary=key_values(sequences=report.sequences, tokens=report.tokens,
                                               input_scales=report.input_scales, seconds=report.seconds),
                            details=scalar_fields(report.model_dump(mode="json")))
