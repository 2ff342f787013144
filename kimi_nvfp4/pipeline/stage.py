"""What the runner needs from a stage: a name, its settings, whether it already ran with them, and `run`.

The runner only orchestrates (order, resume, first failure, summary); each stage adapter in `stages/` turns its
pipeline.toml section into the stage's options model, calls the stage's Python API and reads/writes its record
in the manifest.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from ..errors import GateFailure

if TYPE_CHECKING:  # config.py builds PipelineConfig from the stage adapters, which import this module
    from .config import PipelineConfig


@dataclass
class StageContext:
    source: Path  # as given: a local folder, or a Hub repo id that convert downloads
    output: Path
    config: PipelineConfig
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
