"""`kimi-nvfp4 demo`: the README's first command, end to end on the bundled tiny checkpoint."""

from __future__ import annotations

import pytest

from kimi_nvfp4.cli import main
from kimi_nvfp4.pipeline import StageStatus
from kimi_nvfp4.pipeline.demo import DEMO_CONFIG, demo_checkpoint, demo_config


def test_demo_preset_is_cpu_and_uploads_nothing():
    config = demo_config()
    assert config.device == "cpu"
    assert config.serve_check.enabled and config.serve_check.reference and config.serve_check.quick
    assert config.publish.enabled and config.publish.dry_run  # the card is shown, nothing leaves the machine
    assert (demo_checkpoint() / "config.json").is_file()
    assert DEMO_CONFIG["calibrate"]["data"] == "builtin"  # needs no download


@pytest.mark.slow  # the whole pipeline on CPU: a few minutes
def test_demo_runs_every_stage_and_prints_the_summary(tmp_path, capsys):
    try:
        main(["demo", str(tmp_path / "demo"), "--no-progress"])
        code = 0
    except SystemExit as e:
        code = int(e.code or 0)
    printed = capsys.readouterr().out
    assert code == 0, printed
    for stage in ("convert", "calibrate", "validate", "serve_check", "publish"):
        assert any(line.startswith(stage) and " ran " in line for line in printed.splitlines()), stage
    assert "pipeline OK" in printed
    reports = tmp_path / "demo" / "nvfp4" / "reports"
    card = (reports / "model_card_preview.md").read_text()
    assert "## Serving check" in card and "All gates passed" in card
    assert (reports / "serve_check.png").is_file() and (reports / "pipeline_summary.json").is_file()

    # the second demo resumes: only the (always shown) publish dry run runs again
    from kimi_nvfp4.pipeline import run_demo

    again = run_demo(tmp_path / "demo", progress=False)
    active = [s.status for s in again.stages if s.name != "requantize"]  # off in the demo
    assert active[:4] == [StageStatus.SKIPPED] * 4 and again.exit_code == 0
