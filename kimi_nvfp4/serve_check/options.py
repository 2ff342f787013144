"""`ServeCheckOptions`: serve-check's options, read by `kimi-nvfp4 serve-check`, `[serve_check]` in pipeline.toml
and `run_serve_check` (see kimi_nvfp4/stage_options.py for how one field becomes all three).

The load sweep and the quality checks are their own models (`LoadConfig`, `QualityConfig`); given as tables of
overrides (pipeline.toml's `load = {...}`, the command's `--turns`, `--no-humaneval`, ...) they start from the
default or, with `quick`, the quick preset.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, field_validator, model_validator

from ..stage_options import Cli, StageOptions
from .launcher import DEFAULT_READY_TIMEOUT_S
from .profiles import DEFAULT_PORT, PROFILES, parse_extra_args
from .replay import ReplayConfig
from .report import QualityConfig
from .workload import LoadConfig


def _over_preset(preset: LoadConfig | QualityConfig, overrides: dict[str, Any], quick: bool) -> dict[str, Any]:
    """The fields a preset sets (`quick` only), with `overrides` on top; validated as the field's model, so an
    error names the key (`load.turns`)."""
    return {**(preset.model_dump(exclude_unset=True) if quick else {}), **overrides}


class ServeCheckOptions(StageOptions):
    profile: str | None = Field(None, description=f"launch SGLang with a profile: {', '.join(PROFILES)} "
                                                  "(suffix -naive: radix cache off, BF16 KV)")
    url: str | None = Field(None, description="use a server that is already running (SGLang or serve-reference) "
                                              "instead")
    compare: str | None = Field(None, description="second configuration (profile or URL) measured with the same "
                                                  "load, same chart")
    extra_args: Annotated[tuple[str, ...], Cli(click_type=str)] = Field(
        (), description="extra SGLang flags, override the profile's (quoted string)")
    compare_extra_args: Annotated[tuple[str, ...], Cli(click_type=str)] = Field(
        (), description="extra SGLang flags for --compare")
    port: int = Field(DEFAULT_PORT, description="port for a launched SGLang")
    ready_timeout_s: Annotated[float, Cli("--ready-timeout")] = Field(
        DEFAULT_READY_TIMEOUT_S, description="seconds to wait for /health_generate")
    quick: bool = Field(False, description="small load and quality sets (the demo preset, ~1-2 min on CPU)")
    load: Annotated[LoadConfig | None, Cli(hidden=True)] = Field(
        None, description="the closed-loop load sweep; None: no sweep")
    replay: Annotated[ReplayConfig | None, Cli(hidden=True)] = Field(
        None, description="replay recorded traffic (serve_check/replay.py) as the load; None: no replay")
    quality: Annotated[QualityConfig, Cli(hidden=True)] = Field(
        default_factory=QualityConfig, description="which quality smoke tests run, and the gates")

    @field_validator("extra_args", "compare_extra_args", mode="before")
    @classmethod
    def _split_flags(cls, value: Any) -> Any:
        """A quoted string of flags (the command line's form) -> its words."""
        return parse_extra_args(value) if value is None or isinstance(value, str) else value

    @model_validator(mode="before")
    @classmethod
    def _presets(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        quick = bool(data.get("quick", False))
        if isinstance(data.get("load"), dict):
            data["load"] = _over_preset(LoadConfig.quick(), data["load"], quick)
        quality = data.get("quality")
        if quality is None or isinstance(quality, dict):
            data["quality"] = _over_preset(QualityConfig.quick(), quality or {}, quick)
        return data
