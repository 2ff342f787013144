"""The report: what counts as a miss, and its JSON / Markdown files."""

from __future__ import annotations

import json

from kimi_nvfp4.engine_check.report import (
    BuildDevice,
    CpuPatch,
    EngineCheckReport,
    ParameterFinding,
    ParameterVerdict,
    TensorAccounting,
    ValueCheck,
)


def _report(**kw) -> EngineCheckReport:
    return EngineCheckReport(engine="sglang", engine_version="0.5.23", checkpoint="/x", device=BuildDevice.CPU, **kw)


def _finding(verdict: ParameterVerdict) -> ParameterFinding:
    return ParameterFinding(parameter=f"p.{verdict.value}", dtype="float32", shape=[2], unwritten=2, numel=2,
                            verdict=verdict, reason="why")


def test_only_misses_fail_the_check():
    ok = _report(
        tensors=TensorAccounting(in_checkpoint=3, read=3, routed=3),
        parameter_findings=[_finding(v) for v in ParameterVerdict if v is not ParameterVerdict.MISS],
        values=[ValueCheck(name="v", passed=True, checked=1, detail="")],
    )
    assert ok.passed and ok.misses == []
    bad = _report(
        tensors=TensorAccounting(in_checkpoint=3, read=2, routed=1, not_read=["a"], dropped=["b"]),
        parameter_findings=[_finding(ParameterVerdict.MISS)],
        values=[ValueCheck(name="v", passed=False, checked=1, detail="differs")],
        errors=["loading raised X"],
    )
    assert not bad.passed and len(bad.misses) == 5
    assert any(m.startswith("tensor never read by the engine: a") for m in bad.misses)


def test_report_files_round_trip_and_markdown_names_the_patches(tmp_path):
    report = _report(
        tensors=TensorAccounting(in_checkpoint=1, read=1, routed=1),
        patches=[CpuPatch(target="torchvision", why="no CUDA", effect="stand-in")],
        values=[ValueCheck(name="expert bytes", passed=True, checked=4, detail="4 bit-exact")],
        not_run=["the shuffle"],
    )
    json_path, md_path = report.save(tmp_path)
    assert EngineCheckReport.model_validate(json.loads(json_path.read_text())) == report
    md = md_path.read_text()
    assert "PASS" in md and "| torchvision | no CUDA | stand-in |" in md and "- the shuffle" in md
