"""The orchestrator on small in-test stages: order, resume, invalidation, first failure, summary.

These stages are real implementations of the `Stage` protocol that record themselves in a JSON file, which is
all the runner may rely on; the real stages are exercised end to end in test_pipeline_e2e.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kimi_nvfp4.errors import CheckpointError, GateFailure
from kimi_nvfp4.pipeline import PipelineConfig, StageContext, StageOutcome, StageStatus, run_stages
from kimi_nvfp4.pipeline.runner import INTERNAL_ERROR_EXIT_CODE


class RecordingStage:
    """Appends its name to a run log; remembers completed settings in `OUTPUT/records.json`."""

    def __init__(self, name: str, settings: dict | None = None, behaviour: object = None):
        self.name = name
        self._settings = settings or {"v": 1}
        self.behaviour = behaviour  # None: succeed; an exception: raise it; "gate": fail a gate

    def _records(self, ctx: StageContext) -> dict:
        path = ctx.output / "records.json"
        return json.loads(path.read_text()) if path.exists() else {}

    def settings(self, ctx: StageContext) -> dict:
        return dict(self._settings)

    def completed_settings(self, ctx: StageContext) -> dict | None:
        return self._records(ctx).get(self.name)

    def run(self, ctx: StageContext) -> StageOutcome:
        with (ctx.output / "runs.log").open("a") as f:
            f.write(self.name + "\n")
        if isinstance(self.behaviour, BaseException):
            raise self.behaviour
        if self.behaviour == "gate":
            return StageOutcome.gate_failed("kl 0.9 > 0.05")
        return StageOutcome(summary=f"{self.name} done")

    def mark_complete(self, ctx: StageContext, settings: dict, outcome: StageOutcome) -> None:
        records = self._records(ctx)
        records[self.name] = settings
        (ctx.output / "records.json").write_text(json.dumps(records))


def _ctx(tmp_path: Path) -> StageContext:
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    return StageContext(tmp_path / "src", out, PipelineConfig(), out / "reports", progress=False)


def _runs(ctx: StageContext) -> list[str]:
    path = ctx.output / "runs.log"
    return path.read_text().split() if path.exists() else []


def _stages(**overrides) -> list[tuple[RecordingStage, bool]]:
    names = ["convert", "calibrate", "validate", "serve_check", "publish"]
    return [(overrides.get(n, RecordingStage(n)), n != "serve_check") for n in names]


def test_runs_enabled_stages_in_order_and_writes_one_summary(tmp_path):
    ctx = _ctx(tmp_path)
    summary = run_stages(_stages(), ctx)
    assert _runs(ctx) == ["convert", "calibrate", "validate", "publish"]
    assert [s.status for s in summary.stages] == [StageStatus.RAN] * 3 + [StageStatus.DISABLED, StageStatus.RAN]
    assert summary.exit_code == 0 and summary.ok
    table = summary.to_table()
    assert table.splitlines()[0].split() == ["stage", "status", "time", "result"]
    assert "calibrate done" in table and "pipeline OK" in table
    data = json.loads((ctx.report_dir / "pipeline_summary.json").read_text())
    assert data["exit_code"] == 0 and [s["status"] for s in data["stages"]][3] == "disabled"
    assert "| validate | ran |" in (ctx.report_dir / "pipeline_summary.md").read_text()


def test_rerun_skips_stages_finished_with_the_same_settings(tmp_path):
    ctx = _ctx(tmp_path)
    run_stages(_stages(), ctx)
    summary = run_stages(_stages(), ctx)
    assert _runs(ctx) == ["convert", "calibrate", "validate", "publish"]  # nothing ran the second time
    assert {s.status for s in summary.stages} == {StageStatus.SKIPPED, StageStatus.DISABLED}


def test_changed_settings_rerun_that_stage_and_everything_after_it(tmp_path):
    ctx = _ctx(tmp_path)
    run_stages(_stages(), ctx)
    summary = run_stages(_stages(calibrate=RecordingStage("calibrate", {"v": 2})), ctx)
    assert _runs(ctx)[4:] == ["calibrate", "validate", "publish"]  # convert skipped, downstream invalidated
    assert summary.result("convert").status is StageStatus.SKIPPED
    assert summary.result("validate").status is StageStatus.RAN


@pytest.mark.parametrize(
    "behaviour, exit_code",
    [
        ("gate", 1),
        (GateFailure("w4a4.kl_mean 0.2 > 0.05"), 1),
        (CheckpointError("truncated shard", file="model-00001.safetensors"), 3),
        (RuntimeError("bug"), INTERNAL_ERROR_EXIT_CODE),
    ],
    ids=["gate-outcome", "gate-raised", "checkpoint-error", "internal-error"],
)
def test_stops_at_the_first_failure_with_its_exit_code(tmp_path, behaviour, exit_code):
    ctx = _ctx(tmp_path)
    summary = run_stages(_stages(validate=RecordingStage("validate", behaviour=behaviour),
                                 publish=RecordingStage("publish", behaviour=CheckpointError("later"))), ctx)
    assert _runs(ctx) == ["convert", "calibrate", "validate"]
    assert summary.exit_code == exit_code
    assert summary.result("validate").status is StageStatus.FAILED
    assert summary.result("publish").status is StageStatus.NOT_RUN
    assert f"pipeline FAILED (exit {exit_code})" in summary.to_table()


def test_a_failed_stage_is_not_recorded_and_runs_again(tmp_path):
    ctx = _ctx(tmp_path)
    run_stages(_stages(validate=RecordingStage("validate", behaviour="gate")), ctx)
    summary = run_stages(_stages(), ctx)
    assert summary.result("calibrate").status is StageStatus.SKIPPED
    assert summary.result("validate").status is StageStatus.RAN
    assert summary.ok


def test_convert_is_not_skipped_for_a_different_source(tmp_path, make_tiny_k2):
    """The real convert adapter: a finished output made from another source is handed back to convert."""
    from kimi_nvfp4.convert import convert_checkpoint
    from kimi_nvfp4.convert.stage import ConvertStage

    src_a = make_tiny_k2(tmp_path / "a", layers=2, experts=4, vocab_size=256)
    src_b = make_tiny_k2(tmp_path / "b", layers=2, experts=4, vocab_size=256, seed=1)
    out = tmp_path / "out"
    convert_checkpoint(src_a, out, progress=False)
    stage = ConvertStage()
    ctx_a = StageContext(src_a, out, PipelineConfig(), out / "reports", progress=False)
    ctx_b = StageContext(src_b, out, PipelineConfig(), out / "reports", progress=False)
    assert stage.completed_settings(ctx_a) is not None
    assert set(stage.settings(ctx_a)) == {"method", "kv_cache_quant_algo", "shared_experts", "shared_expert_scales"}
    assert stage.completed_settings(ctx_a).items() >= stage.settings(ctx_a).items()
    assert stage.completed_settings(ctx_b) is None


def test_a_setting_the_stage_did_not_record_is_added_so_a_rerun_skips(tmp_path):
    """validate records its own settings; the pipeline's `gates` (None without overrides) must be added to the
    record, or the next run would never find it and run validate again."""
    from kimi_nvfp4.checkpoint.manifest import (ConversionManifest, ConversionSettings, SourceRecord, StageRecord,
                                                load_manifest, save_manifest)
    from kimi_nvfp4.stage_kit.pipeline_stage import ManifestRecordedStage

    class SelfRecordingStage(ManifestRecordedStage):
        name = "validate"

        def settings(self, ctx: StageContext) -> dict:
            return {"samples": 2, "gates": None}

        def run(self, ctx: StageContext) -> StageOutcome:
            manifest = load_manifest(ctx.output)
            manifest.stages[self.name] = StageRecord(settings={"samples": 2}, complete=True)
            save_manifest(ctx.output, manifest)
            return StageOutcome(summary="validated")

    ctx = _ctx(tmp_path)
    save_manifest(ctx.output, ConversionManifest(
        source=SourceRecord(path=str(tmp_path / "src")), complete=True,
        settings=ConversionSettings(method="amax", kv_cache_quant_algo=None)))
    assert run_stages([(SelfRecordingStage(), True)], ctx).result("validate").status is StageStatus.RAN
    assert load_manifest(ctx.output).stages["validate"].settings == {"samples": 2, "gates": None}
    assert run_stages([(SelfRecordingStage(), True)], ctx).result("validate").status is StageStatus.SKIPPED
