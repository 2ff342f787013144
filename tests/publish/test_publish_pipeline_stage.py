"""The pipeline's publish stage against the loopback Hub: upload once, skip when recorded, dry runs always show."""

from __future__ import annotations

import pytest

from kimi_nvfp4.pipeline import StageContext, StageStatus, pipeline_config_from_dict, run_stages
from kimi_nvfp4.publish.stage import PublishStage

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:httpx2")


def _ctx(folder, **publish) -> StageContext:
    config = pipeline_config_from_dict({"publish": {"enabled": True, "repo_id": "me/x", **publish}})
    return StageContext(folder, folder, config, folder / "reports", progress=False)


def test_real_publish_is_recorded_then_skipped(publishable, hub):
    first = run_stages([(PublishStage(), True)], _ctx(publishable, endpoint=hub.url))
    assert first.result("publish").status is StageStatus.RAN, first.to_table()
    assert "uploaded" in first.result("publish").summary and len(hub.state.repos["me/x"].commits) == 1
    again = run_stages([(PublishStage(), True)], _ctx(publishable, endpoint=hub.url))
    assert again.result("publish").status is StageStatus.SKIPPED
    to_branch = run_stages([(PublishStage(), True)], _ctx(publishable, endpoint=hub.url, revision="v2"))
    assert to_branch.result("publish").status is StageStatus.RAN
    assert "config.json" in hub.files("me/x", "v2")


def test_dry_run_always_runs_and_writes_the_card_preview(publishable, hub):
    for _ in range(2):
        summary = run_stages([(PublishStage(), True)], _ctx(publishable, dry_run=True))
        assert summary.result("publish").status is StageStatus.RAN
    preview = (publishable / "reports" / "model_card_preview.md").read_text()
    assert preview.startswith("---\n") and "## Usage" in preview
    assert not hub.state.requests  # a dry run never talks to the Hub


def test_refusal_becomes_the_stage_exit_code(publishable, hub, write_manifest):
    (publishable / "reports" / "validate_report.json").unlink()
    write_manifest(publishable, validate=None)
    summary = run_stages([(PublishStage(), True)], _ctx(publishable, endpoint=hub.url))
    assert summary.result("publish").status is StageStatus.FAILED and summary.exit_code == 1
    assert "validate has not run" in summary.result("publish").summary
