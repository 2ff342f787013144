"""The publish stage in the pipeline: a dry run writes the model card preview; a real upload is recorded."""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from ..checkpoint.writer import write_bytes_atomic
from ..stage_kit.pipeline_stage import ManifestRecordedStage, StageContext, StageOutcome, section_options
from .api import publish_checkpoint
from .files import format_size
from .options import PublishOptions

CARD_PREVIEW_NAME = "model_card_preview.md"


class PublishSection(PublishOptions):
    """[publish]: publish's options, plus the Hub repository."""

    enabled: bool = False
    repo_id: str | None = Field(None, description="NAMESPACE/NAME on the Hub")

    @model_validator(mode="after")
    def _needs_repo(self) -> PublishSection:
        if self.enabled and not self.repo_id:
            raise ValueError("publish.enabled = true needs publish.repo_id")
        return self


class PublishStage(ManifestRecordedStage):
    name = "publish"
    Section = PublishSection

    def options(self, ctx: StageContext) -> PublishOptions:
        return section_options(ctx, ctx.config.section(self.name), PublishOptions)

    def settings(self, ctx: StageContext) -> dict[str, Any]:
        return {"repo_id": ctx.config.section(self.name).repo_id, **self.options(ctx).recorded()}

    def completed_settings(self, ctx: StageContext) -> dict[str, Any] | None:
        # A dry run is cheap and always shown; a real upload re-checks and resumes (huggingface_hub skips
        # what the Hub already has), so it only counts as done when recorded with the same repo and options.
        return None if self.options(ctx).dry_run else super().completed_settings(ctx)

    def run(self, ctx: StageContext) -> StageOutcome:
        repo_id = ctx.config.section(self.name).repo_id
        options = self.options(ctx)
        result = publish_checkpoint(ctx.output, repo_id, options, report_dir=ctx.report_dir, progress=ctx.progress)
        size = f"{len(result.files)} files, {format_size(result.total_bytes)}"
        if options.dry_run:
            ctx.report_dir.mkdir(parents=True, exist_ok=True)
            preview = ctx.report_dir / CARD_PREVIEW_NAME
            write_bytes_atomic(preview, result.card.encode())
            return StageOutcome(summary=f"dry run: {size} for {repo_id}; card preview {preview.name}",
                                details=result.to_dict())
        where = result.upload.commit_url or result.upload.repo_url
        return StageOutcome(summary=f"uploaded {size} to {where}", details=result.to_dict())

    def mark_complete(self, ctx: StageContext, settings: dict[str, Any], outcome: StageOutcome) -> None:
        """publish_checkpoint records a real upload itself; a dry run is not recorded."""
