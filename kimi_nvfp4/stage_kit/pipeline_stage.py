"""What a stage offers `kimi-nvfp4 run`, and what its adapter shares with the others.

Each pipeline stage keeps its adapter in its own package (`<stage>/stage.py`, named by its entry in
kimi_nvfp4/registry.py): a class with a `name` (its pipeline.toml section and manifest record), a `Section` model
(the stage's options model plus pipeline-only keys such as `enabled`) and the runner's `Stage` protocol below,
which turns its section into the stage's options and calls the stage's Python API. The runner (pipeline/runner.py)
only orchestrates: order, resume, first failure, summary.

The adapters see the pipeline's configuration only through `PipelineSections` (a top-level `device` and one
section per stage), so nothing here or in a stage imports the pipeline package.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, ClassVar, Protocol, TypeVar, runtime_checkable

from ..checkpoint.manifest import MANIFEST_NAME, ConversionManifest, StageRecord, load_manifest, save_manifest
from ..errors import CheckpointError, GateFailure
from ..stage_options import StageOptions

OptionsT = TypeVar("OptionsT", bound=StageOptions)
# Agent sessions over the installed stdlib (data/loaders.py `resolve_data_spec`): data that every machine has.
DEFAULT_DATA = "builtin"


class PipelineSections(Protocol):
    """What an adapter reads of pipeline.toml (pipeline/config.py's `PipelineConfig` is one)."""

    device: str

    def section(self, stage_name: str) -> Any:
        """The `[stage_name]` section: the stage's `Section` model."""


@dataclass
class StageContext:
    source: Path  # as given: a local folder, or a Hub repo id that convert downloads
    output: Path
    config: PipelineSections
    report_dir: Path
    progress: bool = True


@dataclass
class StageOutcome:
    """What a stage returned. `ok=False` is a failed gate (exit `exit_code`); errors are raised instead."""

    ok: bool = True
    summary: str = ""  # one line for the summary table
    exit_code: int = 0
    details: dict[str, Any] = field(default_factory=dict)  # JSON-able; goes into pipeline_summary.json

    @classmethod
    def gate_failed(cls, summary: str, **details: Any) -> StageOutcome:
        return cls(ok=False, summary=summary, exit_code=GateFailure.exit_code, details=details)


@runtime_checkable
class Stage(Protocol):
    name: str

    def settings(self, ctx: StageContext) -> dict[str, Any]:
        """Device-independent options that determine the stage's output (what resume compares)."""

    def completed_settings(self, ctx: StageContext) -> dict[str, Any] | None:
        """Settings of the last COMPLETE run recorded in the output folder, or None."""

    def run(self, ctx: StageContext) -> StageOutcome:
        """Do the work; raise a KimiNvfp4Error on bad input, return ok=False for a failed gate."""

    def mark_complete(self, ctx: StageContext, settings: dict[str, Any], outcome: StageOutcome) -> None:
        """Make sure the output folder records this run as complete with `settings` (if the stage did not)."""


def normalise(value: Any) -> Any:
    """JSON round trip: tuples become lists, Paths strings, so recorded and wanted settings compare equal."""
    return json.loads(json.dumps(value, default=str, sort_keys=True))


def settings_match(recorded: dict[str, Any] | None, wanted: dict[str, Any]) -> bool:
    """True when every wanted setting was recorded with the same value (extra recorded keys are the stage's own)."""
    if recorded is None:
        return False
    recorded, wanted = normalise(recorded), normalise(wanted)
    return all(key in recorded and recorded[key] == value for key, value in wanted.items())


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
    """A stage that records itself in `manifest.stages[name]` (calibrate, requantize, validate, serve-check,
    publish). Subclasses set `name` and `Section` (their pipeline.toml section model) and implement `settings`
    and `run`."""

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
