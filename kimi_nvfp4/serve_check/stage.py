"""The serve-check stage in the pipeline: against SGLang (`profile`), a running server (`url`), or the in-process
reference server over the converted checkpoint (`reference = true`; what `demo` uses on CPU)."""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from ..stage_kit.device_type import OptionalDevice
from ..stage_kit.pipeline_stage import (
    ManifestRecordedStage,
    StageContext,
    StageOutcome,
    gates_line,
    scalar_fields,
    section_options,
)
from .options import ServeCheckOptions


class ServeCheckSection(ServeCheckOptions):
    """[serve_check]: serve-check's options, plus where the checkpoint is served and whether to load it."""

    enabled: bool = False
    reference: bool = Field(False, description="serve the checkpoint through the in-process reference emulator")
    no_load: bool = Field(False, description="quality checks only (no load sweep)")
    device: OptionalDevice = Field(None, description="device of the reference emulator (default: the pipeline's)")

    @model_validator(mode="after")
    def _one_target(self) -> ServeCheckSection:
        chosen = [name for name, on in (("profile", self.profile), ("url", self.url), ("reference", self.reference))
                  if on]
        if self.enabled and len(chosen) != 1:
            got = ", ".join(chosen) or "none"
            raise ValueError(f"serve_check needs exactly one of profile, url, reference = true (got {got})")
        return self


def _emulator_device(device: str) -> str:
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


class ServeCheckStage(ManifestRecordedStage):
    name = "serve_check"
    Section = ServeCheckSection

    def settings(self, ctx: StageContext) -> dict[str, Any]:
        section = ctx.config.section(self.name)
        return section.model_dump(mode="json", exclude={"enabled", "device"})

    def options(self, ctx: StageContext, **where: Any) -> ServeCheckOptions:
        """The section's options; `load` left out is the default (or quick) sweep, unless `no_load`."""
        section = ctx.config.section(self.name)
        options = section_options(ctx, section, ServeCheckOptions)
        load = None if section.no_load else (options.load if "load" in section.model_fields_set else {})
        return ServeCheckOptions.build(options, {"load": load, **where}, "serve_check")

    def run(self, ctx: StageContext) -> StageOutcome:
        from .api import run_serve_check

        section = ctx.config.section(self.name)
        if section.reference:
            from .engine import EmulatorEngine
            from .reference_server import ReferenceServer

            engine = EmulatorEngine(ctx.output, device=_emulator_device(section.device or ctx.config.device))
            with ReferenceServer(engine) as server:
                report = run_serve_check(ctx.output, self.options(ctx, url=server.base_url),
                                         report_dir=ctx.report_dir, progress=ctx.progress)
        else:
            report = run_serve_check(ctx.output, self.options(ctx), report_dir=ctx.report_dir,
                                     progress=ctx.progress)
        target = report.target
        line = gates_line(report.gates, report.failed_gates())
        line += " (reference emulator)" if target.reference_emulator else f" ({target.label})"
        details = scalar_fields(report.model_dump(mode="json"))
        if not report.passed:
            return StageOutcome.gate_failed(line, **details)
        return StageOutcome(summary=line, details=details)
