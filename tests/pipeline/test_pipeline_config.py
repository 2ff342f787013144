"""pipeline.toml parsing: sections per stage, errors that name the file and the option."""

from __future__ import annotations

import pytest

from kimi_nvfp4.pipeline import load_pipeline_config, pipeline_config_from_dict
from kimi_nvfp4.pipeline.config import ConfigError

EXAMPLE = """
device = "cuda"

[convert]
method = "sweep"
kv_cache_quant_algo = "none"

[calibrate]
data = "jsonl:sessions.jsonl"
samples = 512

[validate]
samples = 64
modes = ["w4a4"]
gate_overrides = ["w4a4.kl_mean_max=0.08"]

[serve_check]
enabled = true
profile = "b200-tp4"
load = { concurrency = [1, 8, 32] }

[publish]
enabled = true
repo_id = "me/Kimi-K2.6-NVFP4"
private = true
"""


def test_example_config_round_trips(tmp_path):
    path = tmp_path / "pipeline.toml"
    path.write_text(EXAMPLE)
    config = load_pipeline_config(path)
    assert config.device == "cuda"
    assert config.convert.method == "sweep" and config.convert.workers is None  # unset = stage default
    assert config.calibrate.samples == 512 and config.calibrate.seq_len is None
    assert config.validate_.modes == ["w4a4"] and config.validate_.gate_overrides == ["w4a4.kl_mean_max=0.08"]
    assert config.serve_check.load == {"concurrency": [1, 8, 32]}
    assert config.publish.private is True
    assert config.report_path(tmp_path / "out") == tmp_path / "out" / "reports"
    assert pipeline_config_from_dict(config.to_toml_dict()) == config


def test_defaults_enable_the_three_core_stages_only():
    config = load_pipeline_config(None)
    assert config.calibrate.enabled and config.validate_.enabled
    assert not config.serve_check.enabled and not config.publish.enabled


@pytest.mark.parametrize(
    "text, expected",
    [
        ("[calibrate]\nsampels = 3\n", "calibrate.sampels: Extra inputs are not permitted"),
        ("[validate]\nsamples = 'many'\n", "validate.samples:"),
        ("[publish]\nenabled = true\n", "publish.enabled = true needs publish.repo_id"),
        ("[serve_check]\nenabled = true\n", "exactly one of profile, url, reference"),
        ("[serve_check]\nenabled = true\nurl = 'http://x'\nreference = true\n", "exactly one of"),
        ("[quantize]\nx = 1\n", "quantize: Extra inputs are not permitted"),
        ("device = \n", "not valid TOML"),
    ],
    ids=["typo", "type", "publish-repo", "serve-target-none", "serve-target-two", "unknown-section", "toml"],
)
def test_bad_config_names_file_and_option(tmp_path, text, expected):
    path = tmp_path / "pipeline.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_pipeline_config(path)
    assert str(e.value).startswith(str(path)) and expected in str(e.value)
    assert e.value.exit_code == 2


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_pipeline_config(tmp_path / "nope.toml")


def test_cli_exits_with_the_first_failing_stage_code(tmp_path, capsys):
    """`kimi-nvfp4 run` on a source that is not a checkpoint: convert fails (exit 3), nothing else runs."""
    from kimi_nvfp4.cli import main

    (tmp_path / "not_a_checkpoint").mkdir()
    try:
        main(["run", str(tmp_path / "not_a_checkpoint"), str(tmp_path / "out"), "--no-progress"])
        code = 0
    except SystemExit as e:
        code = int(e.code or 0)
    captured = capsys.readouterr()
    assert code == 3
    assert "convert      FAILED" in captured.out and "calibrate    not run" in captured.out
    assert captured.err.startswith("error: stage convert failed (exit 3)")
