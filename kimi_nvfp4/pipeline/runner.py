"""`run_pipeline`: run the stages in order, skip those already complete with the same settings, stop at the
first failure, and return one summary whose `exit_code` is that of the first failing stage.

Resume rule: a stage is skipped when its output folder records a complete run with the same settings AND no
earlier stage ran in this invocation (a re-run upstream invalidates everything downstream: new weights need new
scales, new scales need a new validation).
"""

from __future__ import annotations

import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path

from tqdm.auto import tqdm

from ..checkpoint.output_lock import holds_output_lock
from ..errors import INTERNAL_ERROR_EXIT_CODE, KimiNvfp4Error, exit_code_for  # noqa: F401 (re-exported)
from .config import PipelineConfig
from ..registry import pipeline_stages
from ..stage_kit.pipeline_stage import Stage, StageContext, StageOutcome, settings_match
from .summary import PipelineSummary, StageResult, StageStatus


def _run_one(stage: Stage, ctx: StageContext, settings: dict) -> tuple[StageOutcome, BaseException | None]:
    try:
        outcome = stage.run(ctx)
    except KimiNvfp4Error as e:
        return StageOutcome(ok=False, summary=str(e), exit_code=exit_code_for(e)), e
    except Exception as e:  # noqa: BLE001 — reported with its traceback, the summary still prints
        traceback.print_exc(file=sys.stderr)
        return StageOutcome(ok=False, summary=f"internal error: {type(e).__name__}: {e}",
                            exit_code=exit_code_for(e)), e
    if outcome.ok:
        stage.mark_complete(ctx, settings, outcome)
    elif outcome.exit_code == 0:
        outcome.exit_code = 1
    return outcome, None


def run_stages(
    stages: Sequence[tuple[Stage, bool]],
    ctx: StageContext,
    *,
    write_summary: bool = True,
) -> PipelineSummary:
    """Run `(stage, enabled)` pairs in order (the orchestration `run_pipeline` builds on)."""
    results: list[StageResult] = []
    failed = False
    upstream_ran = False
    enabled_count = sum(1 for _, enabled in stages if enabled)
    with tqdm(total=enabled_count, desc="pipeline", unit="stage", disable=not ctx.progress, position=0) as bar:
        for stage, enabled in stages:
            if not enabled:
                results.append(StageResult(stage.name, StageStatus.DISABLED, summary="off in config"))
                continue
            if failed:
                results.append(StageResult(stage.name, StageStatus.NOT_RUN, summary="an earlier stage failed"))
                bar.update(1)
                continue
            bar.set_postfix_str(stage.name)
            start = time.monotonic()
            try:
                settings = stage.settings(ctx)
                done = not upstream_ran and settings_match(stage.completed_settings(ctx), settings)
            except KimiNvfp4Error as e:
                results.append(StageResult(stage.name, StageStatus.FAILED, time.monotonic() - start, str(e),
                                           e.exit_code))
                failed = True
                bar.update(1)
                continue
            if done:
                results.append(StageResult(stage.name, StageStatus.SKIPPED, time.monotonic() - start,
                                           "already complete with the same settings", details={"settings": settings}))
                bar.update(1)
                continue
            outcome, _ = _run_one(stage, ctx, settings)
            upstream_ran = True
            status = StageStatus.RAN if outcome.ok else StageStatus.FAILED
            failed = not outcome.ok
            results.append(StageResult(stage.name, status, time.monotonic() - start, outcome.summary,
                                       outcome.exit_code if failed else 0,
                                       {"settings": settings, **outcome.details}))
            bar.update(1)
    summary = PipelineSummary(str(ctx.source), str(ctx.output), results, str(ctx.report_dir))
    if write_summary and ctx.output.is_dir():
        summary.write(ctx.report_dir)
    return summary


# Held across every stage; an output nested with a local source is refused first (checkpoint/output_lock.py).
@holds_output_lock("run", "output", create=True, source_arg="source")
def run_pipeline(
    source: str | Path,
    output: str | Path,
    config: PipelineConfig | None = None,
    *,
    progress: bool = True,
) -> PipelineSummary:
    """convert -> calibrate -> requantize (if enabled) -> validate -> serve-check (if enabled) -> publish (if enabled).

    Never raises for a stage failure: the failure is in the summary and `summary.exit_code`.
    """
    config = config or PipelineConfig()
    output = Path(output)
    ctx = StageContext(Path(source), output, config, config.report_path(output), progress)
    return run_stages(build_stages(config), ctx)


def build_stages(config: PipelineConfig) -> list[tuple[Stage, bool]]:
    """The stage sequence with each stage's enabled flag (a section without `enabled`, convert's, always runs)."""
    return [(stage(), getattr(config.section(stage.name), "enabled", True)) for stage in pipeline_stages()]
