"""The serve-check stage as the pipeline runs it: against SGLang (profile), a running server (url), or the
in-process reference server over the converted checkpoint (reference = true; what `demo` uses on CPU)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import ValidationError

from .config import ConfigError
from .stage import StageContext
from .stages import call_with_options


def _load_and_quality(ctx: StageContext) -> tuple[Any, Any]:
    """LoadConfig / QualityConfig from the [serve_check] section (`quick` = the serve-check --quick presets)."""
    from ..serve_check.report import QualityConfig
    from ..serve_check.workload import LoadConfig

    s = ctx.config.serve_check
    load_over, quality_over = dict(s.load or {}), dict(s.quality or {})
    try:
        load = None if s.no_load else (LoadConfig.quick(**load_over) if s.quick else LoadConfig(**load_over))
        quality = QualityConfig.quick(**quality_over) if s.quick else QualityConfig(**quality_over)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ConfigError(f"[serve_check] load/quality option {where}: {first['msg']}") from None
    return load, quality


def _emulator_device(device: str) -> str:
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def run_serve_check_stage(fn: Callable[..., Any], ctx: StageContext) -> Any:
    s = ctx.config.serve_check
    load, quality = _load_and_quality(ctx)
    options: dict[str, Any] = {"report_dir": ctx.report_dir, "compare": s.compare, "load": load,
                               "quality": quality, "progress": ctx.progress}
    if s.reference:
        from ..serve_check.engine import EmulatorEngine
        from ..serve_check.reference_server import ReferenceServer

        device = ctx.config.stage_device(s.device)
        engine = EmulatorEngine(ctx.output, device=_emulator_device(device))
        with ReferenceServer(engine) as server:
            return call_with_options(fn, "serve_check", ctx.output, url=server.base_url, **options)
    return call_with_options(fn, "serve_check", ctx.output, profile=s.profile, url=s.url, **options)
