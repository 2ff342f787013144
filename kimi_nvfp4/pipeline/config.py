"""`pipeline.toml`: one section per stage, mirroring that stage's Python API options.

An option left out (None) means "the stage's own default", so the config never restates defaults that could
drift from the stage code. Example:

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
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import tomllib
from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from ..errors import KimiNvfp4Error


class ConfigError(KimiNvfp4Error):
    """pipeline.toml is unreadable or has an unknown/ill-typed option."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ConvertSection(_Section):
    revision: str | None = None  # when SOURCE is a Hub repo id
    method: str | None = None
    device: str | None = None
    workers: int | None = None
    kv_cache_quant_algo: str | None = None  # "FP8" or "none"
    overwrite: bool = False
    fsync: bool | None = None  # False: leave write-back to the OS (`convert --no-fsync`)


class CalibrateSection(_Section):
    enabled: bool = True
    data: str | None = None  # a --data spec: jsonl:PATH, hf:NAME[:SPLIT], tree:PATH, builtin
    samples: int | None = None
    seq_len: int | None = None
    seed: int | None = None
    min_expert_tokens: int | None = None
    policy: str | None = None
    device: str | None = None
    dtype: str | None = None  # auto (bf16 on CUDA, fp32 on CPU), float32, bfloat16


class ValidateSection(_Section):
    enabled: bool = True
    data: str | None = None  # default: calibrate's data (validate uses its held-out part)
    samples: int | None = None
    seq_len: int | None = None
    seed: int | None = None
    modes: list[str] | None = None  # w4a4, w4a16
    input_scale_reduction: str | None = None
    gates_file: str | None = None  # TOML/JSON thresholds (validate's `load_gates`)
    gate_overrides: list[str] | None = None  # KEY=VALUE, e.g. "w4a4.kl_mean_max=0.08"
    device: str | None = None


class ServeCheckSection(_Section):
    enabled: bool = False
    profile: str | None = None  # launch SGLang with this profile (b200-tp4, ...)
    url: str | None = None  # or measure a server that is already running
    reference: bool = False  # or serve the checkpoint through the in-process reference emulator
    quick: bool = False  # the short load/quality run (the demo's)
    compare: str | None = None  # a second profile or URL measured with the same workload
    load: dict[str, Any] | None = None  # LoadConfig fields (concurrency, turns, input_tokens, ...)
    quality: dict[str, Any] | None = None  # QualityConfig fields (humaneval_limit, ...)
    no_load: bool = False  # quality checks only
    device: str | None = None  # for the reference emulator

    @model_validator(mode="after")
    def _one_target(self) -> ServeCheckSection:
        chosen = [name for name, on in (("profile", self.profile), ("url", self.url), ("reference", self.reference))
                  if on]
        if self.enabled and len(chosen) != 1:
            got = ", ".join(chosen) or "none"
            raise ValueError(f"serve_check needs exactly one of profile, url, reference = true (got {got})")
        return self


class PublishSection(_Section):
    enabled: bool = False
    repo_id: str | None = None
    private: bool = False
    revision: str | None = None
    dry_run: bool = False
    force_unvalidated: bool = False
    base_model: str | None = None
    endpoint: str | None = None

    @model_validator(mode="after")
    def _needs_repo(self) -> PublishSection:
        if self.enabled and not self.repo_id:
            raise ValueError("publish.enabled = true needs publish.repo_id")
        return self


class PipelineConfig(_Section):
    device: str = "auto"  # default for every stage that does not set its own
    report_dir: Path | None = None  # default: OUTPUT/reports
    convert: ConvertSection = ConvertSection()
    calibrate: CalibrateSection = CalibrateSection()
    validate_: ValidateSection = ValidateSection()
    serve_check: ServeCheckSection = ServeCheckSection()
    publish: PublishSection = PublishSection()

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    @model_validator(mode="before")
    @classmethod
    def _rename_validate(cls, data: Any) -> Any:
        # `validate` is a BaseModel method name; the TOML section keeps the natural name.
        if isinstance(data, dict) and "validate" in data:
            data = dict(data)
            data["validate_"] = data.pop("validate")
        return data

    def stage_device(self, section_device: str | None) -> str:
        return section_device or self.device

    def report_path(self, output: Path) -> Path:
        return Path(self.report_dir) if self.report_dir else Path(output) / "reports"

    def to_toml_dict(self) -> dict[str, Any]:
        data = self.model_dump(mode="json", exclude_none=True)
        data["validate"] = data.pop("validate_")
        return data


def _format_error(path: str, error: ValidationError) -> str:
    first = error.errors()[0]
    loc = ".".join("validate" if p == "validate_" else str(p) for p in first["loc"]) or "(top level)"
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
