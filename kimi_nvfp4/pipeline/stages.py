"""Adapters from the pipeline config to each stage's Python API, plus each stage's resume record.

Every adapter passes only the options the config sets (None = the stage's own default) and reads the stage's
defaults from its signature, so `settings()` is the complete, device-independent set the stage ran with.
Stage modules are imported when the stage runs, keeping `kimi-nvfp4 run --help` fast.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from ..checkpoint.manifest import MANIFEST_NAME
from ..errors import CheckpointError, KimiNvfp4Error
from .config import ConfigError, PipelineConfig
from .stage import Stage, StageContext, StageOutcome

DEFAULT_DATA = "builtin"  # agent sessions over the installed stdlib (data/loaders.py `resolve_data_spec`)


def load_stage_function(target: str) -> Callable[..., Any]:
    module_name, attr = target.split(":")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise KimiNvfp4Error(f"stage function {target} is not available ({e})") from None


def call_with_options(fn: Callable[..., Any], stage: str, *args: Any, **options: Any) -> Any:
    """Call `fn` with the options that are set; a set option the function does not take is a config error."""
    params = inspect.signature(fn).parameters
    takes_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    kwargs = {}
    for key, value in options.items():
        if value is None:
            continue
        if key not in params and not takes_kwargs:
            raise ConfigError(f"[{stage}] option {key!r} is not an option of {fn.__module__}.{fn.__name__}")
        kwargs[key] = value
    return fn(*args, **kwargs)


def resolved_settings(fn: Callable[..., Any], keys: tuple[str, ...], chosen: dict[str, Any]) -> dict[str, Any]:
    """`chosen` values where set, the function's defaults elsewhere (keys it lacks are left out)."""
    params = inspect.signature(fn).parameters
    out = {}
    for key in keys:
        if chosen.get(key) is not None:
            out[key] = chosen[key]
        elif key in params and params[key].default is not inspect.Parameter.empty:
            default = params[key].default
            out[key] = default.value if hasattr(default, "value") else default  # str Enum -> its value
    return out


def _load_manifest_or_none(ctx: StageContext) -> Any | None:
    from ..checkpoint.manifest import load_manifest

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
    manifest = _load_manifest_or_none(ctx)
    if manifest is None or not Path(manifest.source.path).is_dir():
        raise CheckpointError("source is neither a local folder nor recorded by a finished convert",
                              file=ctx.source)
    return Path(manifest.source.path)


def describe(result: Any, fields: tuple[str, ...]) -> str:
    """A one-line summary from whichever of `fields` the stage's result has."""
    parts = []
    for name in fields:
        value = getattr(result, name, None)
        if value is None and isinstance(result, dict):
            value = result.get(name)
        if value is None or isinstance(value, (list, dict)):
            continue
        parts.append(f"{name}={value:.4g}" if isinstance(value, float) else f"{name}={value}")
    return ", ".join(parts)


def result_details(result: Any) -> dict[str, Any]:
    if hasattr(result, "model_dump"):
        data = result.model_dump(mode="json")
    elif hasattr(result, "to_dict"):
        data = result.to_dict()
    else:
        return {}
    # Keep the summary small: scalars only (the stage's own report has everything).
    return {k: v for k, v in data.items() if isinstance(v, (str, int, float, bool)) or v is None}


class ManifestRecordedStage:
    """A stage that records itself in `manifest.stages[name]` (calibrate, validate, serve-check, publish)."""

    name: str = ""
    target: str = ""
    setting_keys: tuple[str, ...] = ()

    def __init__(self) -> None:
        self._fn: Callable[..., Any] | None = None

    @property
    def fn(self) -> Callable[..., Any]:
        if self._fn is None:
            self._fn = load_stage_function(self.target)
        return self._fn

    def chosen(self, ctx: StageContext) -> dict[str, Any]:
        raise NotImplementedError

    def settings(self, ctx: StageContext) -> dict[str, Any]:
        return resolved_settings(self.fn, self.setting_keys, self.chosen(ctx))

    def completed_settings(self, ctx: StageContext) -> dict[str, Any] | None:
        manifest = _load_manifest_or_none(ctx)
        if manifest is None or not manifest.complete:
            return None
        record = manifest.stages.get(self.name)
        if record is None or not record.complete or record.outputs.get("passed") is False:
            return None  # never ran, crashed, or failed its gates: run again
        return dict(record.settings)

    def mark_complete(self, ctx: StageContext, settings: dict[str, Any], outcome: StageOutcome) -> None:
        """Add the pipeline's resolved settings to the stage's own record (or create one if it wrote none)."""
        from ..checkpoint.manifest import StageRecord, load_manifest, save_manifest

        manifest = load_manifest(ctx.output)
        record = manifest.stages.get(self.name)
        if record is None:
            manifest.stages[self.name] = StageRecord(
                settings=dict(settings), complete=True,
                finished_at=datetime.now(timezone.utc).isoformat(timespec="seconds"), outputs={})
        elif all(record.settings.get(k) == v for k, v in settings.items()) and record.complete:
            return
        else:
            record.settings = {**settings, **record.settings}
            record.complete = True
        save_manifest(ctx.output, manifest)


class ConvertStage:
    """convert_checkpoint; its record is the manifest itself (`complete` + top-level `settings`)."""

    name = "convert"
    target = "kimi_nvfp4.convert:convert_checkpoint"
    setting_keys = ("method", "kv_cache_quant_algo")

    fn = ManifestRecordedStage.fn

    def __init__(self) -> None:
        self._fn: Callable[..., Any] | None = None

    def settings(self, ctx: StageContext) -> dict[str, Any]:
        c = ctx.config.convert
        settings = resolved_settings(self.fn, self.setting_keys,
                                     {"method": c.method, "kv_cache_quant_algo": c.kv_cache_quant_algo})
        # convert records "no KV cache quantization" as null (convert/api.py maps "none" -> None)
        if str(settings.get("kv_cache_quant_algo")).lower() == "none":
            settings["kv_cache_quant_algo"] = None
        return settings

    def completed_settings(self, ctx: StageContext) -> dict[str, Any] | None:
        manifest = _load_manifest_or_none(ctx)
        if manifest is None or not manifest.complete or not self._same_source(ctx, manifest.source):
            return None  # convert itself then resumes, or refuses an output made from another source
        settings = manifest.settings
        return settings.model_dump(mode="json") if hasattr(settings, "model_dump") else dict(settings)

    @staticmethod
    def _same_source(ctx: StageContext, recorded: Any) -> bool:
        if ctx.source.is_dir():
            return Path(recorded.path).resolve() == ctx.source.resolve()
        return recorded.repo_id == str(ctx.source) and recorded.revision == ctx.config.convert.revision

    def run(self, ctx: StageContext) -> StageOutcome:
        c = ctx.config.convert
        result = call_with_options(
            self.fn, self.name, str(ctx.source), ctx.output, method=c.method,
            device=ctx.config.stage_device(c.device), workers=c.workers, kv_cache_quant_algo=c.kv_cache_quant_algo,
            overwrite=c.overwrite or None, revision=c.revision, fsync=c.fsync, progress=ctx.progress)
        return StageOutcome(summary=describe(result, ("method", "shards_converted", "shards_skipped",
                                                      "matrices_converted", "seconds")),
                            details=result_details(result))

    def mark_complete(self, ctx: StageContext, settings: dict[str, Any], outcome: StageOutcome) -> None:
        """convert_checkpoint writes the manifest with `complete` and its settings itself."""


class CalibrateStage(ManifestRecordedStage):
    name = "calibrate"
    target = "kimi_nvfp4.calibrate:calibrate_checkpoint"
    setting_keys = ("data", "samples", "seq_len", "seed", "min_expert_tokens", "policy")

    def chosen(self, ctx: StageContext) -> dict[str, Any]:
        c = ctx.config.calibrate
        # `dtype` is passed on but not compared on resume (the manifest records the resolved dtype).
        return {"data": c.data or DEFAULT_DATA, "samples": c.samples, "seq_len": c.seq_len, "seed": c.seed,
                "min_expert_tokens": c.min_expert_tokens, "policy": c.policy, "dtype": c.dtype}

    def run(self, ctx: StageContext) -> StageOutcome:
        c = ctx.config.calibrate
        options = {k: v for k, v in self.chosen(ctx).items() if k != "data"}
        result = call_with_options(self.fn, self.name, ctx.output, local_source(ctx), c.data or DEFAULT_DATA,
                                   device=ctx.config.stage_device(c.device), progress=ctx.progress,
                                   report_dir=ctx.report_dir, **options)
        return StageOutcome(summary=describe(result, ("sequences", "tokens", "input_scales", "seconds")),
                            details=result_details(result))


class ValidateStage(ManifestRecordedStage):
    name = "validate"
    target = "kimi_nvfp4.validate:validate_checkpoint"
    # validate records data/samples/seq_len/seed/modes/input_scale_reduction itself; the pipeline adds `gates`.
    setting_keys = ("data", "samples", "seq_len", "seed", "modes", "input_scale_reduction", "gates")

    def thresholds(self, ctx: StageContext) -> Any | None:
        v = ctx.config.validate_
        if v.gates_file is None and not v.gate_overrides:
            return None
        from ..validate import load_gates

        return load_gates(v.gates_file, tuple(v.gate_overrides or ()))

    def chosen(self, ctx: StageContext) -> dict[str, Any]:
        v = ctx.config.validate_
        gates = self.thresholds(ctx)
        return {"data": v.data or ctx.config.calibrate.data or DEFAULT_DATA, "samples": v.samples,
                "seq_len": v.seq_len, "seed": v.seed, "modes": v.modes,
                "input_scale_reduction": v.input_scale_reduction,
                "gates": gates.model_dump() if gates is not None else None}

    def run(self, ctx: StageContext) -> StageOutcome:
        v = ctx.config.validate_
        chosen = self.chosen(ctx)
        options = {k: chosen[k] for k in ("samples", "seq_len", "seed", "modes", "input_scale_reduction")}
        report = call_with_options(self.fn, self.name, ctx.output, local_source(ctx), chosen["data"],
                                   report_dir=ctx.report_dir, gates=self.thresholds(ctx),
                                   device=ctx.config.stage_device(v.device), progress=ctx.progress, **options)
        failed = [g.name for g in report.failed_gates()] if hasattr(report, "failed_gates") else []
        line = f"{len(report.gates) - len(failed)}/{len(report.gates)} gates passed" if hasattr(report, "gates") \
            else ""
        if failed:
            line += f"; failed: {', '.join(failed)}"
        if not report_passed(report):
            return StageOutcome.gate_failed(line or "a validation gate failed", **result_details(report))
        return StageOutcome(summary=line, details=result_details(report))


def report_passed(report: Any) -> bool:
    for name in ("passed", "ok", "all_passed"):
        value = getattr(report, name, None)
        if callable(value):
            value = value()
        if isinstance(value, bool):
            return value
    raise KimiNvfp4Error(f"{type(report).__name__} has no pass/fail verdict (expected a `passed` attribute)")


class ServeCheckStage(ManifestRecordedStage):
    name = "serve_check"
    target = "kimi_nvfp4.serve_check.api:run_serve_check"

    def settings(self, ctx: StageContext) -> dict[str, Any]:
        s = ctx.config.serve_check
        return s.model_dump(mode="json", exclude={"enabled", "device"})

    def run(self, ctx: StageContext) -> StageOutcome:
        from .serve import run_serve_check_stage

        report = run_serve_check_stage(self.fn, ctx)
        failed = [g.name for g in report.failed_gates()] if hasattr(report, "failed_gates") else []
        gates = getattr(report, "gates", [])
        line = f"{len(gates) - len(failed)}/{len(gates)} gates passed" + (f"; failed: {', '.join(failed)}"
                                                                          if failed else "")
        target = getattr(report, "target", None)
        if target is not None:
            line += " (reference emulator)" if getattr(target, "reference_emulator", False) else f" ({target.label})"
        if not report_passed(report):
            return StageOutcome.gate_failed(line, **result_details(report))
        return StageOutcome(summary=line, details=result_details(report))


class PublishStage(ManifestRecordedStage):
    name = "publish"
    target = "kimi_nvfp4.publish:publish_checkpoint"
    setting_keys = ("repo_id", "revision", "private", "force_unvalidated")

    def chosen(self, ctx: StageContext) -> dict[str, Any]:
        p = ctx.config.publish
        return {"repo_id": p.repo_id, "revision": p.revision, "private": p.private,
                "force_unvalidated": p.force_unvalidated}

    def settings(self, ctx: StageContext) -> dict[str, Any]:
        return self.chosen(ctx)

    def completed_settings(self, ctx: StageContext) -> dict[str, Any] | None:
        # A dry run is cheap and always shown; a real upload re-checks and resumes (huggingface_hub skips
        # what the Hub already has), so it only counts as done when recorded with the same repo and options.
        return None if ctx.config.publish.dry_run else super().completed_settings(ctx)

    def run(self, ctx: StageContext) -> StageOutcome:
        from ..publish.files import format_size

        p = ctx.config.publish
        result = self.fn(ctx.output, p.repo_id, private=p.private, revision=p.revision, dry_run=p.dry_run,
                         force_unvalidated=p.force_unvalidated, report_dir=ctx.report_dir, base_model=p.base_model,
                         endpoint=p.endpoint, progress=ctx.progress)
        size = f"{len(result.files)} files, {format_size(result.total_bytes)}"
        if p.dry_run:
            ctx.report_dir.mkdir(parents=True, exist_ok=True)
            preview = ctx.report_dir / "model_card_preview.md"
            from ..checkpoint.writer import write_bytes_atomic

            write_bytes_atomic(preview, result.card.encode())
            return StageOutcome(summary=f"dry run: {size} for {p.repo_id}; card preview {preview.name}",
                                details=result.to_dict())
        where = result.upload.commit_url or result.upload.repo_url
        return StageOutcome(summary=f"uploaded {size} to {where}", details=result.to_dict())

    def mark_complete(self, ctx: StageContext, settings: dict[str, Any], outcome: StageOutcome) -> None:
        """publish_checkpoint records a real upload itself; a dry run is not recorded."""


def build_stages(config: PipelineConfig) -> list[tuple[Stage, bool]]:
    """The stage sequence with each stage's enabled flag (convert always runs or resumes)."""
    return [
        (ConvertStage(), True),
        (CalibrateStage(), config.calibrate.enabled),
        (ValidateStage(), config.validate_.enabled),
        (ServeCheckStage(), config.serve_check.enabled),
        (PublishStage(), config.publish.enabled),
    ]
