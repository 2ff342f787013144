"""The convert stage in the pipeline; its record is the manifest itself (`complete` + top-level `settings`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..checkpoint.manifest import SourceRecord
from ..stage_kit.pipeline_stage import (
    StageContext,
    StageOutcome,
    key_values,
    load_manifest_or_none,
    scalar_fields,
    section_options,
)
from .api import convert_checkpoint
from .options import ConvertOptions


class ConvertSection(ConvertOptions):
    """[convert]: convert's options. Convert always runs (or resumes); it has no `enabled`."""


class ConvertStage:
    name = "convert"
    Section = ConvertSection

    def options(self, ctx: StageContext) -> ConvertOptions:
        return section_options(ctx, ctx.config.section(self.name), ConvertOptions)

    def settings(self, ctx: StageContext) -> dict[str, Any]:
        return self.options(ctx).recorded()

    def completed_settings(self, ctx: StageContext) -> dict[str, Any] | None:
        manifest = load_manifest_or_none(ctx)
        if manifest is None or not manifest.complete or not self._same_source(ctx, manifest.source):
            return None  # convert itself then resumes, or refuses an output made from another source
        return manifest.settings.model_dump(mode="json")

    def _same_source(self, ctx: StageContext, recorded: SourceRecord) -> bool:
        if ctx.source.is_dir():
            return Path(recorded.path).resolve() == ctx.source.resolve()
        return recorded.repo_id == str(ctx.source) and recorded.revision == self.options(ctx).revision

    def run(self, ctx: StageContext) -> StageOutcome:
        result = convert_checkpoint(str(ctx.source), ctx.output, self.options(ctx), progress=ctx.progress)
        return StageOutcome(summary=key_values(method=result.method, shards_converted=result.shards_converted,
                                               shards_skipped=result.shards_skipped,
                                               matrices_converted=result.matrices_converted,
                                               seconds=result.seconds),
                            details=scalar_fields(result.to_dict()))

    def mark_complete(self, ctx: StageContext, settings: dict[str, Any], outcome: StageOutcome) -> None:
        """convert_checkpoint writes the manifest with `complete` and its settings itself."""
