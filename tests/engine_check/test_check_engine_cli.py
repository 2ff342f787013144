"""`kimi-nvfp4 check-engine` exit codes that need no engine: bad input (3), engine missing (8), misses (1)."""

from __future__ import annotations

import importlib.metadata

import pytest

from kimi_nvfp4.cli import main
from kimi_nvfp4.engine_check import cli as engine_cli
from kimi_nvfp4.engine_check.report import BuildDevice, EngineCheckReport, ValueCheck
from kimi_nvfp4.engine_check.sglang_session import sglang_version
from kimi_nvfp4.errors import EngineUnavailableError


def _exit_code(argv: list[str]) -> int:
    with pytest.raises(SystemExit) as e:
        main(argv)
    return e.value.code


def test_a_folder_that_is_not_a_converted_checkpoint_exits_3_before_any_engine_runs(tiny_int4_checkpoint, capsys):
    assert _exit_code(["check-engine", str(tiny_int4_checkpoint)]) == 3  # the INT4 source: no hf_quant_config.json
    assert "hf_quant_config.json is missing" in capsys.readouterr().err


def test_missing_engine_exits_8(monkeypatch, tmp_path, capsys):
    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    with pytest.raises(EngineUnavailableError) as e:
        sglang_version()
    assert e.value.exit_code == 8 and "requirements-engines-cpu.txt" in str(e.value)

    def check_engine(*args, **kwargs):
        raise EngineUnavailableError("SGLang is not installed")

    monkeypatch.setattr(engine_cli, "check_engine", check_engine)
    assert _exit_code(["check-engine", str(tmp_path)]) == 8
    assert "SGLang is not installed" in capsys.readouterr().err


def test_a_miss_exits_1_and_is_printed(monkeypatch, tmp_path, capsys):
    report = EngineCheckReport(engine="sglang", engine_version="0.5.23", checkpoint=str(tmp_path),
                               device=BuildDevice.CPU,
                               values=[ValueCheck(name="expert bytes", passed=False, checked=1, detail="differ")])
    monkeypatch.setattr(engine_cli, "check_engine", lambda *a, **k: report)
    assert _exit_code(["check-engine", str(tmp_path)]) == 1
    out = capsys.readouterr()
    assert "miss: value check expert bytes: differ" in out.out and "1 misses" in out.err


def test_a_child_that_dies_without_an_answer_is_a_typed_error_naming_its_exit_code(demo_w4a16, monkeypatch, tmp_path):
    """The engine's process can die (OOM killer, an abort inside the engine): exit 11 naming its code, no bare bug."""
    import sys

    from kimi_nvfp4.engine_check import check_engine
    from kimi_nvfp4.errors import EngineProcessError

    monkeypatch.setattr(sys, "executable", "/bin/false")  # a real process that exits 1 and writes nothing
    with pytest.raises(EngineProcessError, match="ended with exit code 1 and wrote no answer") as e:
        check_engine(demo_w4a16, "sglang", report_dir=tmp_path)
    assert e.value.exit_code == 11


def test_engines_come_from_the_registry_and_refuse_unknown_options(demo_w4a16, tmp_path):
    from kimi_nvfp4.engine_check import ENGINES, CheckCoverage, check_engine
    from kimi_nvfp4.errors import KimiNvfp4Error

    assert {e.name: e.coverage for e in ENGINES.entries()} == {"sglang": CheckCoverage.LOADER,
                                                               "vllm": CheckCoverage.RULES}
    with pytest.raises(KimiNvfp4Error, match="unknown engine 'trtllm'; registered: sglang, vllm"):
        check_engine(demo_w4a16, "trtllm")
    with pytest.raises(KimiNvfp4Error, match="vllm: option moe_runner_backend"):
        check_engine(demo_w4a16, "vllm", moe_runner_backend="marlin")


def test_a_rules_only_pass_never_reads_like_a_loader_pass(tmp_path):
    from kimi_nvfp4.engine_check import CheckCoverage

    loader = EngineCheckReport(engine="sglang", engine_version="0.5.23", checkpoint="x", device=BuildDevice.CPU)
    rules = loader.model_copy(update={"engine": "vllm", "coverage": CheckCoverage.RULES})
    assert loader.verdict == "PASS: no miss"
    assert rules.verdict.startswith("PASS (rules only)") and "no weight loader ran" in rules.verdict
    assert "NOT detected" in rules.to_markdown()
