"""The validate stage in the pipeline; a failed gate fails the stage (exit 1)."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from ..stage_kit.pipeline_stage import (
    DEFAULT_DATA,
    ManifestRecordedStage,
    StageContext,
    StageOutcome,
    gates_line,
    local_source,
    scalar_fields,
    section_options,
)
from .api import validate_checkpoint
from .options import ValidateOptions


class ValidateSection(ValidateOptions):
    """[validate]: validate's options, plus the data whose held-out part it runs on."""

    enabled: bool = True
    data: str | None = Field(None, description="a --data spec (default: calibrate's; validate uses its held-out "
                                               "part)")


class ValidateStage(ManifestRecordedStage):
    name = "validate"
    Section = ValidateSection

    def data(self, ctx: StageContext) -> str:
        return ctx.config.section(self.name).data or ctx.config.section("calibrate").data or DEFAULT_DATA

    def options(self, ctx: StageContext) -> ValidateOptions:
        return section_options(ctx, ctx.config.section(self.name), ValidateOptions)

    def settings(self, ctx: StageContext) -> dict[str, Any]:
        # validate records data and its own settings itself; the pipeline adds the thresholds as `gates`.
        options = self.options(ctx)
        gates = options.thresholds().model_dump() if options.sets_thresholds else None
        return {"data": self.data(ctx), **options.recorded(), "gates": gates}

    def run(self, ctx: StageContext) -> StageOutcome:
        report = validate_checkpoint(ctx.output, local_source(ctx), self.data(ctx), self.options(ctx),
                                     report_dir=ctx.report_dir, progress=ctx.progress)
        line = gates_line(report.gates, report.failed_gates())
        details = scalar_fields(report.model_dump(mode="json"))
        if not report.passed:
            return StageOutcome.gate_failed(line, **details)
        return StageOutcome(summary=line, details=details)
