import json

import pytest
from click.testing import CliRunner

from kimi_nvfp4.errors import GateFailure, KimiNvfp4Error
from kimi_nvfp4.serve_check.api import raise_on_failure, run_serve_check
from kimi_nvfp4.serve_check.cli import serve_check_command, serve_reference_command
from kimi_nvfp4.serve_check.loadgen import LoadPoint, LoadSweep
from kimi_nvfp4.serve_check.report import Gates, QualityConfig, QualityReport, evaluate_gates, summarise_checks
from kimi_nvfp4.serve_check.workload import LoadConfig

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _sweep(errors=0):
    point = LoadPoint(concurrency=2, requests=10, errors=errors, error_samples=[], timed_out=False, duration_s=1.0,
                      ttft_p50_s=0.1, ttft_p99_s=0.2, tpot_p50_ms=10.0, tpot_mean_ms=11.0, interactivity_tok_s=100.0,
                      throughput_tok_min_gpu=1000.0, output_tok_s=50.0, mean_prompt_tokens=100.0,
                      mean_completion_tokens=5.0, cache_hit_rate=0.9, usage_missing=0)
    return LoadSweep(label="x", base_url="http://h", num_gpus=1, context_length=4096, first_context_tokens=10,
                     tool_result_tokens=5, output_tokens=5, turns=2, points=[point])


def test_gates_fail_on_errors_and_on_checks_that_could_not_run():
    cfg = QualityConfig(humaneval=False, tool_calls=False)
    quality = QualityReport(errors={"agreement": "no model"})
    gates = evaluate_gates(Gates.reference(), _sweep(errors=1), quality, cfg)
    by_name = {g.name: g for g in gates}
    assert not by_name["load error rate"].passed and by_name["load error rate"].value == pytest.approx(0.1)
    crashed = by_name["emulator agreement ran"]
    assert not crashed.passed and crashed.value is None and crashed.error == "no model"
    assert all(g.passed for g in evaluate_gates(Gates(), _sweep(), QualityReport(), QualityConfig(
        humaneval=False, tool_calls=False, agreement=False)))


@pytest.mark.parametrize("check", ["humaneval", "tool_calls"])
def test_a_crashed_check_fails_even_where_it_is_not_gated(check):
    """Reference gates do not gate HumanEval or tool calls; a crash of either still fails the report."""
    cfg = QualityConfig(agreement=False)
    other = {"humaneval": "tool_calls", "tool_calls": "humaneval"}[check]
    quality = QualityReport(errors={check: "RuntimeError: boom", other: "also"})
    gates = evaluate_gates(Gates.reference(), _sweep(), quality, cfg, reference_emulator=True)
    failed = [g for g in gates if not g.passed]
    assert {g.check for g in failed} == {"humaneval", "tool_calls"}
    assert all(g.comparison == "ran" and g.error for g in failed)


def test_check_kinds_say_what_is_compared():
    cfg = QualityConfig()
    quality = QualityReport(errors={"humaneval": "x", "tool_calls": "x", "agreement": "x"})
    ref = {c.name: c.kind.value for c in summarise_checks(_sweep(), quality, cfg, reference_emulator=True)}
    assert ref == {"load sweep": "operational", "HumanEval": "independent", "tool calls": "independent",
                   "emulator agreement": "self-consistency"}
    prod = {c.name: c.kind.value for c in summarise_checks(_sweep(), quality, cfg, reference_emulator=False)}
    assert prod["emulator agreement"] == "independent"


def test_a_crashed_check_fails_the_report_and_says_so(scripted_server, tmp_path, monkeypatch):
    from kimi_nvfp4.serve_check import api

    async def crash(*args, **kwargs):
        raise RuntimeError("the HumanEval data is missing")

    monkeypatch.setattr(api, "run_humaneval", crash)
    url, _ = scripted_server()
    report = run_serve_check(tmp_path, url=url, report_dir=tmp_path / "rep", load=None, progress=False,
                             quality=QualityConfig.quick(agreement=False))
    assert not report.passed
    (failed,) = report.failed_gates()
    assert failed.name == "HumanEval ran" and "HumanEval data is missing" in failed.error
    md = (tmp_path / "rep" / "serve_check.md").read_text()
    assert "# Serve check: FAILED" in md and "**FAIL** (crashed)" in md
    assert "| HumanEval | independent | HumanEval's unit tests | **crashed**: RuntimeError" in md
    data = json.loads((tmp_path / "rep" / "serve_check.json").read_text())
    assert data["passed"] is False and data["gates"][-1]["kind"] == "independent"
    with pytest.raises(GateFailure, match="HumanEval ran: crashed"):
        raise_on_failure(report)


def test_serve_check_against_url_writes_report(scripted_server, tmp_path):
    url, _ = scripted_server()
    report = run_serve_check(
        tmp_path, url=url, report_dir=tmp_path / "rep", progress=False,
        load=LoadConfig.quick(concurrency=[1, 2], turns=2, input_tokens=100, output_tokens=3),
        quality=QualityConfig.quick(humaneval_limit=1, agreement=False),
        compare=url,
    )
    assert report.target.reference_emulator and report.passed
    assert [g.name for g in report.gates] == ["load error rate"]  # reference gates: no tiny-model quality gates
    assert [(c.name, c.ran) for c in report.checks] == [("load sweep", True), ("HumanEval", True),
                                                        ("tool calls", True)]
    assert report.quality.tool_calls.prompts == 4 and report.quality.tool_calls.suite == "agent"
    assert report.quality.humaneval.problems == 1
    files = {p.name for p in (tmp_path / "rep").iterdir()}
    assert {"serve_check.json", "serve_check.md", "serve_check.png"} <= files
    assert not any(name.endswith(".partial") for name in files)
    assert (tmp_path / "rep" / "serve_check.png").read_bytes().startswith(PNG_MAGIC)
    data = json.loads((tmp_path / "rep" / "serve_check.json").read_text())
    assert len(data["load"]["points"]) == 2 and data["compare"]["label"] == url
    md = (tmp_path / "rep" / "serve_check.md").read_text()
    assert "# Serve check: PASSED" in md and "| 2 |" in md


def test_production_gates_fail_and_raise(scripted_server, tmp_path):
    url, engine = scripted_server()
    report = run_serve_check(tmp_path, url=url, report_dir=tmp_path / "rep", load=None, progress=False,
                             quality=QualityConfig.quick(agreement=False, humaneval_limit=1, gates=Gates.production()))
    assert not report.passed
    assert engine.last_template_kwargs == {"thinking": False}  # HumanEval asks for a direct answer
    with pytest.raises(GateFailure, match="tool-call trigger rate"):
        raise_on_failure(report)
    assert "**FAIL**" in (tmp_path / "rep" / "serve_check.md").read_text()


def test_needs_exactly_one_target(tmp_path):
    with pytest.raises(KimiNvfp4Error, match="exactly one"):
        run_serve_check(tmp_path, report_dir=tmp_path)


def test_cli_quick_against_url(scripted_server, tmp_path):
    url, _ = scripted_server()
    res = CliRunner().invoke(serve_check_command, [
        str(tmp_path), "--url", url, "--report", str(tmp_path / "r"), "--quick", "--concurrency", "1,2",
        "--turns", "2", "--no-agreement", "--no-humaneval", "--no-progress"])
    assert res.exit_code == 0, res.output
    assert "serve-check passed" in res.output
    res = CliRunner().invoke(serve_check_command, [
        str(tmp_path), "--url", url, "--report", str(tmp_path / "r2"), "--quick", "--no-load", "--no-agreement",
        "--no-humaneval", "--gates", "production", "--no-progress"], standalone_mode=False)
    assert isinstance(res.exception, GateFailure) and res.exception.exit_code == 1


def test_cli_bad_load_value_is_a_usage_error_naming_the_field(tmp_path):
    res = CliRunner().invoke(serve_check_command, [str(tmp_path), "--url", "http://127.0.0.1:9", "--report",
                                                   str(tmp_path / "r"), "--turns", "0"])
    assert res.exit_code == 2 and "load.turns" in res.output


def test_cli_profile_on_a_machine_without_the_gpus(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi
    res = CliRunner().invoke(serve_check_command, [str(tmp_path), "--profile", "b200-tp4", "--report",
                                                   str(tmp_path / "r")], standalone_mode=False)
    assert res.exception is not None and res.exception.exit_code == 5
    assert "nvidia-smi" in str(res.exception)


def test_help_texts():
    for cmd in (serve_check_command, serve_reference_command):
        res = CliRunner().invoke(cmd, ["--help"])
        assert res.exit_code == 0 and "CHECKPOINT" in res.output


def test_bad_compare_profile_fails_before_any_work(scripted_server, tmp_path):
    url, engine = scripted_server()
    with pytest.raises(KimiNvfp4Error, match="unknown serving profile 'b200-tp3'"):
        run_serve_check(tmp_path, url=url, report_dir=tmp_path / "r", compare="b200-tp3", progress=False)
    assert engine.prefix_cache.stats.lookups == 0


def test_markdown_table_cells_escape_pipes():
    from kimi_nvfp4.serve_check.report import _cell

    # the gate "mean |Δlogprob| vs emulator (nats)" used to split its row into extra cells
    assert _cell("mean |Δlogprob| vs emulator") == "mean \\|Δlogprob\\| vs emulator"
    assert _cell("line one\nline two") == "line one line two"
