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
    assert config.convert.method == "sweep" and config.convert.kv_cache_quant_algo is None  # "none"
    assert config.convert.workers == 1 and "workers" not in config.convert.model_fields_set  # the stage default
    assert config.calibrate.samples == 512 and "seq_len" not in config.calibrate.model_fields_set
    assert config.validate_.modes == ["w4a4"] and config.validate_.gate_overrides == ["w4a4.kl_mean_max=0.08"]
    assert config.section("validate") is config.validate_
    assert config.serve_check.load.concurrency == [1, 8, 32]
    assert config.publish.private is True
    assert config.report_path(tmp_path / "out") == tmp_path / "out" / "reports"
    assert pipeline_config_from_dict(config.to_toml_dict()) == config


def test_sections_are_the_stages_options_models():
    """One model per stage: the section is its options model, so TOML keys are the API's keywords."""
    from kimi_nvfp4.calibrate import CalibrateOptions
    from kimi_nvfp4.convert import ConvertOptions
    from kimi_nvfp4.publish import PublishOptions
    from kimi_nvfp4.serve_check.options import ServeCheckOptions
    from kimi_nvfp4.validate import ValidateOptions

    config = load_pipeline_config(None)
    for name, options in [("convert", ConvertOptions), ("calibrate", CalibrateOptions), ("validate", ValidateOptions),
                          ("serve_check", ServeCheckOptions), ("publish", PublishOptions)]:
        assert isinstance(config.section(name), options)


def test_a_stage_without_its_own_device_gets_the_top_level_one(tmp_path):
    from kimi_nvfp4.calibrate.stage import CalibrateStage
    from kimi_nvfp4.convert.stage import ConvertStage
    from kimi_nvfp4.stage_kit.pipeline_stage import StageContext
    from kimi_nvfp4.validate.stage import ValidateStage

    config = pipeline_config_from_dict({"device": "cpu", "calibrate": {"device": "cuda:1", "samples": 8}})
    ctx = StageContext(tmp_path, tmp_path / "out", config, tmp_path / "reports", progress=False)
    assert ConvertStage().options(ctx).device == "cpu"
    assert ValidateStage().options(ctx).device == "cpu"
    calibrate = CalibrateStage().options(ctx)
    assert calibrate.device == "cuda:1" and calibrate.samples == 8 and calibrate.seq_len == 2048
    assert CalibrateStage().settings(ctx) == {"data": "builtin", "samples": 8, "seq_len": 2048, "seed": 0,
                                              "min_expert_tokens": 32, "policy": "peer-max"}
    assert ValidateStage().settings(ctx)["data"] == "builtin" and ValidateStage().settings(ctx)["gates"] is None


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
        ("[convert]\nworkers = 0\n", "convert.workers: Input should be greater than or equal to 1"),
        ("[convert]\nenabled = false\n", "convert.enabled: Extra inputs are not permitted"),
        ("[publish]\nrepo = 'me/x'\n", "publish.repo: Extra inputs are not permitted"),
        ("[serve_check]\nload = { turns = 0 }\n", "serve_check.load.turns:"),
        ("device = \n", "not valid TOML"),
    ],
    ids=["typo", "type", "publish-repo", "serve-target-none", "serve-target-two", "unknown-section",
         "bad-value", "convert-always-runs", "publish-typo", "load-field", "toml"],
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
