"""The requantize stage in the pipeline: off by default; when on, calibrate also records the expert statistics
its method needs (calibrate/stage.py), and this stage rewrites the expert shards after calibrate."""

from __future__ import annotations

from typing import Any

from ..stage_kit.pipeline_stage import (
    ManifestRecordedStage,
    StageContext,
    StageOutcome,
    key_values,
    local_source,
    scalar_fields,
    section_options,
)
from .api import requantize_checkpoint
from .options import RequantizeOptions


class RequantizeSection(RequantizeOptions):
    """[requantize]: requantize's options; `enabled = true` turns the stage (and calibrate's statistics) on."""

    enabled: bool = False


class RequantizeStage(ManifestRecordedStage):
    name = "requantize"
    Section = RequantizeSection

    def options(self, ctx: StageContext) -> RequantizeOptions:
        return section_options(ctx, ctx.config.section(self.name), RequantizeOptions)

    def settings(self, ctx: StageContext) -> dict[str, Any]:
        return self.options(ctx).recorded()

    def run(self, ctx: StageContext) -> StageOutcome:
        result = requantize_checkpoint(ctx.output, local_source(ctx), self.options(ctx), progress=ctx.progress)
        data = result.to_dict()
        return StageOutcome(summary=key_values(**{k: data[k] for k in ("method", "shards_rewritten",
                                                                      "shards_skipped", "seconds")}),
                            details=scalar_fields(data))
