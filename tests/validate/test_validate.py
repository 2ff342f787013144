"""validate end to end: both layouts, structure alone, the memory bound, and the CLI's exit codes."""

from __future__ import annotations

import json
import weakref

import pytest

from kimi_nvfp4.checkpoint.reader import CheckpointReader
from kimi_nvfp4.cli import main
from kimi_nvfp4.model import weights as model_weights
from kimi_nvfp4.validate import DEFAULT_GATES, check_structure, validate_checkpoint

# See test_corruptions.py: an untrained model's top-1 is a coin toss between near-ties.
SYNTHETIC_OVERRIDES = ["w4a4.top1_min=0.5", "w4a16.top1_min=0.5"]


def _gates():
    g = DEFAULT_GATES.model_copy(deep=True)
    g.w4a4.top1_min = g.w4a16.top1_min = 0.5
    return g


def test_deepseek_v3_layout_validates(calibrated_deepseek_pair, tmp_path):
    src, out = calibrated_deepseek_pair
    assert CheckpointReader(out).layout.text_prefix == ""
    report = validate_checkpoint(
        out,
        src,
        "sample",
        report_dir=tmp_path / "r",
        gates=_gates(),
        samples=2,
        seq_len=32,
        device="cpu",
        progress=False,
        record_in_manifest=False,
    )
    assert report.passed, [g for g in report.gates if not g.passed]
    assert (
        report.weights.matrices
        == 3 * len(CheckpointReader(out).layout.text.moe_layers) * CheckpointReader(out).layout.text.n_routed_experts
    )


def test_structure_of_an_uncalibrated_conversion_lacks_only_input_scales(calibrated_pair, tmp_path):
    src, out = calibrated_pair
    from kimi_nvfp4.validate.corruptions import drop_input_scale

    structure = check_structure(CheckpointReader(out), CheckpointReader(src), progress=False)
    assert structure.passed, structure.failed()
    assert structure.nvfp4_linears > 0 and structure.bf16_linears > 0
    name = drop_input_scale(out)
    structure = check_structure(CheckpointReader(out), progress=False)
    assert [c.name for c in structure.failed()] == ["input_scale"]
    assert any(name in issue for issue in structure.failed()[0].issues)


def test_validate_holds_one_layer_of_each_model(calibrated_pair, tmp_path, monkeypatch):
    src, out = calibrated_pair
    live: dict[str, int] = {}
    peak: dict[str, int] = {}
    original = model_weights._CheckpointWeights.layer

    def layer(source, i, *args, **kwargs):
        w = original(source, i, *args, **kwargs)
        kind = source.kind_name
        live[kind] = live.get(kind, 0) + 1
        peak[kind] = max(peak.get(kind, 0), live[kind])
        weakref.finalize(w, lambda: live.__setitem__(kind, live[kind] - 1))
        return w

    monkeypatch.setattr(model_weights._CheckpointWeights, "layer", layer)
    validate_checkpoint(
        out,
        src,
        "sample",
        report_dir=tmp_path / "r",
        gates=_gates(),
        samples=2,
        seq_len=32,
        device="cpu",
        progress=False,
    )
    assert peak == {"int4": 1, "nvfp4": 1}
    assert live == {"int4": 0, "nvfp4": 0}


def _exit_code(argv: list[str]) -> int:
    try:
        main(argv)
    except SystemExit as e:
        return int(e.code)
    return 0


def test_cli_exit_codes_and_report(calibrated_pair, tmp_path, capsys):
    src, out = calibrated_pair
    args = [
        "validate",
        str(out),
        "--source",
        str(src),
        "--data",
        "sample",
        "--samples",
        "2",
        "--seq-len",
        "32",
        "--device",
        "cpu",
        "--no-progress",
    ]
    gate_args = [a for o in SYNTHETIC_OVERRIDES for a in ("--gate", o)]
    assert _exit_code(args + ["--report", str(tmp_path / "ok")] + gate_args) == 0
    assert json.loads((tmp_path / "ok" / "validate_report.json").read_text())["passed"] is True

    assert _exit_code(args + ["--report", str(tmp_path / "bad"), "--gate", "w4a4.kl_mean_max=0"] + gate_args) == 1
    err = capsys.readouterr().err
    assert "w4a4.kl_mean" in err and "gates failed" in err
    report = json.loads((tmp_path / "bad" / "validate_report.json").read_text())
    assert report["passed"] is False  # the report is written even when a gate fails

    assert _exit_code(args + ["--report", str(tmp_path / "x"), "--gate", "w4a4.nope=1"]) == 2
    not_converted = ["validate", str(src), "--source", str(src), "--data", "sample", "--report", str(tmp_path / "y")]
    assert _exit_code(not_converted) == 3


def test_help():
    from click.testing import CliRunner

    from kimi_nvfp4.cli import cli

    for command in ("validate", "calibrate"):
        result = CliRunner().invoke(cli, [command, "--help"])
        assert result.exit_code == 0 and "--source" in result.output and "--data" in result.output


# Input scales this many times too small clip every 16-block whose amax exceeds 1/64 of the layer's (a calibration
# that took a mean or a low percentile for the max): what the default gates exist to refuse. (Too large a scale is
# mostly absorbed by the per-16 E4M3 block scale until it underflows, so x64 larger passes the gates.)
BROKEN_INPUT_SCALE_DIVISOR = 64.0


@pytest.mark.slow
def test_the_default_gates_pass_the_demo_model_and_refuse_it_miscalibrated(tmp_path):
    """The shipped defaults were measured on the demo model, so passing them there alone proves nothing; the same
    gates must refuse the same checkpoint once its input scales are wrong (W4A4 gates fail, W4A16 ones pass: the
    weights are untouched)."""
    from safetensors.torch import load_file, save_file

    from kimi_nvfp4.calibrate import INPUT_SCALES_SHARD, calibrate_checkpoint
    from kimi_nvfp4.convert.api import convert_checkpoint
    from kimi_nvfp4.demo_model import DEMO_CHECKPOINT

    out = tmp_path / "demo_nvfp4"
    convert_checkpoint(DEMO_CHECKPOINT, out, device="cpu", progress=False)
    calibrate_checkpoint(out, DEMO_CHECKPOINT, "sample", samples=8, seq_len=128, device="cpu", progress=False)

    def validate(name: str):
        return validate_checkpoint(out, DEMO_CHECKPOINT, "sample", report_dir=tmp_path / name, samples=8, seq_len=128,
                                   device="cpu", progress=False)

    good = validate("good")
    assert good.passed, [(g.name, g.value, g.threshold) for g in good.gates if not g.passed]

    scales = load_file(out / INPUT_SCALES_SHARD)
    save_file({name: t / BROKEN_INPUT_SCALE_DIVISOR for name, t in scales.items()}, out / INPUT_SCALES_SHARD)
    bad = validate("bad")
    failed = {g.name for g in bad.gates if not g.passed}
    assert not bad.passed and failed and all(name.startswith("w4a4.") for name in failed), failed
