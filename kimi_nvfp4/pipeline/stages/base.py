"""What the stage adapters share: a section's options, the manifest record, the INT4 source, summary lines."""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from ...checkpoint.manifest import MANIFEST_NAME, ConversionManifest, StageRecord, load_manifest, save_manifest
from ...errors import CheckpointError
from ...stage_options import StageOptions
from ..stage import StageContext, StageOutcome, settings_match

OptionsT = TypeVar("OptionsT", bound=StageOptions)
# Agent sessions over the installed stdlib (data/loaders.py `resolve_data_spec`): data that every machine has.
DEFAULT_DATA = "builtin"


def section_options(ctx: StageContext, section: StageOptions, options_type: type[OptionsT]) -> OptionsT:
    """The stage's options from its pipeline.toml section: the keys the section sets (the rest are the stage's
    defaults), and the pipeline's top-level `device` where the stage has a device and the section sets none."""
    chosen = {key: getattr(section, key) for key in section.model_fields_set if key in options_type.model_fields}
    if "device" in options_type.model_fields and "device" not in chosen:
        chosen["device"] = ctx.config.device
    return options_type.model_validate(chosen)


def load_manifest_or_none(ctx: StageContext) -> ConversionManifest | None:
    if not (ctx.output / MANIFEST_NAME).is_file():
        return None
    try:
        return load_manifest(ctx.output)
    except CheckpointError:
        return None


def local_source(ctx: StageContext) -> Path:
    """The INT4 source as a local folder: SOURCE itself, or (for a Hub repo id) where convert downloaded it."""
    if ctx.source.is_dir():
        return ctx.source
    manifest = load_manifest_or_none(ctx)
    if manifest is None or not Path(manifest.source.path).is_dir():
        raise CheckpointError("source is neither a local folder nor recorded by a finished convert",
                              file=ctx.source)
    return Path(manifest.source.path)


def key_values(**fields: Any) -> str:
    """`samples=4, seconds=4.788`: a one-line summary for the table."""
    return ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in fields.items())


def scalar_fields(data: dict[str, Any]) -> dict[str, Any]:
    """The scalar entries of a result's JSON form, for pipeline_summary.json (the stage's own report has all)."""
    return {k: v for k, v in data.items() if isinstance(v, (str, int, float, bool)) or v is None}


def gates_line(gates: list[Any], failed: list[Any]) -> str:
    """`24/27 gates passed; failed: a, b` for validate's and serve-check's gate results."""
    line = f"{len(gates) - len(failed)}/{len(gates)} gates passed"
    return line + (f"; failed: {', '.join(g.name for g in failed)}" if failed else "")


class ManifestRecordedStage:
    """A stage that records itself in `manifest.stages[name]` (calibrate, validate, serve-check, publish).

    Subclasses set `name` and `Section` (their pipeline.toml section model) and implement `settings` and `run`.
    """

    name: ClassVar[str] = ""

    def completed_settings(self, ctx: StageContext) -> dict[str, Any] | None:
        manifest = load_manifest_or_none(ctx)
        if manifest is None or not manifest.complete:
            return None
        record = manifest.stages.get(self.name)
        if record is None or not record.complete or record.outputs.get("passed") is False:
            return None  # never ran, crashed, or failed its gates: run again
        return dict(record.settings)

    def mark_complete(self, ctx: StageContext, settings: dict[str, Any], outcome: StageOutcome) -> None:
        """Add the pipeline's resolved settings to the stage's own record (or create one if it wrote none)."""
        manifest = load_manifest(ctx.output)
        record = manifest.stages.get(self.name)
        if record is None:
            manifest.stages[self.name] = StageRecord(
                settings=dict(settings), complete=True,
                finished_at=datetime.now(timezone.utc).isoformat(timespec="seconds"), outputs={})
        elif record.complete and settings_match(record.settings, settings):
            return  # a key the record lacks (e.g. validate's `gates = None`) must still be added
        else:
            record.settings = {**settings, **record.settings}
            record.complete = True
        save_manifest(ctx.output, manifest)
