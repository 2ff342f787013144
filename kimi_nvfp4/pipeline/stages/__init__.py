"""The pipeline's stage adapters, one module per stage, in the order the registry (kimi_nvfp4/registry.py) gives.

Each adapter has a `name` (its pipeline.toml section and manifest record), a `Section` model (the stage's
options model plus pipeline-only keys such as `enabled`), and implements the runner's `Stage` protocol
(pipeline/stage.py) by turning its section into the stage's options and calling the stage's Python API.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ...registry import COMMANDS, load_target
from .calibrate import CalibrateStage
from .convert import ConvertStage
from .publish import PublishStage
from .requantize import RequantizeStage
from .serve_check import ServeCheckStage
from .validate import ValidateStage

if TYPE_CHECKING:
    from ..config import PipelineConfig
    from ..stage import Stage


def stage_types() -> list[Any]:
    """The adapter classes of the registry's pipeline stages, in pipeline order."""
    return [load_target(command.stage) for command in COMMANDS if command.stage is not None]


def build_stages(config: PipelineConfig) -> list[tuple[Stage, bool]]:
    """The stage sequence with each stage's enabled flag (a section without `enabled`, convert's, always runs)."""
    return [(stage(), getattr(config.section(stage.name), "enabled", True)) for stage in stage_types()]


__all__ = ["CalibrateStage", "ConvertStage", "PublishStage", "RequantizeStage", "ServeCheckStage", "ValidateStage", "build_stages",
           "stage_types"]
