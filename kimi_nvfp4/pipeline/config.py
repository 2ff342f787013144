"""`pipeline.toml`: one section per stage, holding that stage's options (its options model: the same fields as
its command-line options and its Python API's keywords) plus pipeline-only keys such as `enabled`.

An option left out means "the stage's own default", so the config never restates defaults that could drift
from the stage code; unknown keys are errors that name the key (exit 2). Example:

    device = "cuda"                # default device for every stage
    [convert]
    method = "int4-aware"
    [calibrate]
    data = "jsonl:sessions.jsonl"
    samples = 512
    [validate]
    samples = 64
    [serve_check]
    enabled = true
    profile = "b200-tp4"
    [publish]
    enabled = true
    repo_id = "me/Kimi-K2.6-NVFP4"

    [requantize]
    enabled = true
    method = "gptq"
    [requantize.method_options]    # the method's typed options (numerics/methods/catalog/), as --method-option
    damping = 0.02

The sections come from the stage adapters the registry lists (`<stage>/stage.py`, kimi_nvfp4/registry.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import tomllib
from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model

from ..errors import KimiNvfp4Error
from ..registry import pipeline_stages
from ..stage_kit.device_type import Device
from ..stage_options import StageOptions


class ConfigError(KimiNvfp4Error):
    """pipeline.toml is unreadable or has an unknown/ill-typed option."""


def section_field(stage_name: str) -> str:
    """The attribute of a stage's section: its name, or `name_` where BaseModel has that name (`validate`)."""
    return f"{stage_name}_" if hasattr(BaseModel, stage_name) else stage_name


class PipelineSettings(BaseModel):
    """The top-level keys; `PipelineConfig` adds one section per pipeline stage."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    device: Device = "auto"  # default for every stage that does not set its own
    report_dir: Path | None = None  # default: OUTPUT/reports

    def section(self, stage_name: str) -> StageOptions:
        """The `[stage_name]` section (`config.section("validate")`)."""
        return getattr(self, section_field(stage_name))

    def report_path(self, output: Path) -> Path:
        return Path(self.report_dir) if self.report_dir else Path(output) / "reports"

    def to_toml_dict(self) -> dict[str, Any]:
        """The keys that were set, by their pipeline.toml names (reads back to an equal config)."""
        return self.model_dump(mode="json", by_alias=True, exclude_unset=True)


def _pipeline_config_model() -> type[PipelineSettings]:
    sections: dict[str, Any] = {
        section_field(stage.name): (stage.Section, Field(default_factory=stage.Section, alias=stage.name))
        for stage in pipeline_stages()
    }
    return create_model("PipelineConfig", __base__=PipelineSettings, __module__=__name__, **sections)


PipelineConfig = _pipeline_config_model()


def _format_error(path: str, error: ValidationError) -> str:
    first = error.errors()[0]
    loc = ".".join(str(p) for p in first["loc"]) or "(top level)"
    more = f" (and {error.error_count() - 1} more)" if error.error_count() > 1 else ""
    return f"{path}: {loc}: {first['msg']}{more}"


def pipeline_config_from_dict(data: dict[str, Any], *, origin: str = "<config>") -> PipelineConfig:
    try:
        return PipelineConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_error(origin, e)) from None


def load_pipeline_config(path: str | Path | None) -> PipelineConfig:
    """Read pipeline.toml (None: all defaults). Errors name the file and the offending option."""
    if path is None:
        return PipelineConfig()
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: pipeline config not found") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML ({e})") from None
    return pipeline_config_from_dict(data, origin=str(path))
