"""Every catalogued corruption against every registered engine, with the verdict the catalogue (and the table in
docs/engine_check.md generated from it) promises. One demo output per session is built by the fixtures; each case
corrupts a copy of it."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from kimi_nvfp4.engine_check import ENGINES, check_engine
from kimi_nvfp4.engine_check.corruptions import CATALOGUE, TABLE_END, TABLE_START, Outcome, render_into
from kimi_nvfp4.errors import CheckpointError

DOC = Path(__file__).resolve().parents[2] / "docs" / "engine_check.md"


def test_every_case_names_an_expectation_for_every_registered_engine():
    for case in CATALOGUE:
        assert set(case.expected) == set(ENGINES.names()), case.name
    assert any(c.clean for c in CATALOGUE) and sum(not c.clean for c in CATALOGUE) >= 10


def test_the_doc_table_is_the_catalogue():
    doc = DOC.read_text()
    assert TABLE_START in doc and TABLE_END in doc
    assert render_into(doc) == doc, "run: python -m kimi_nvfp4.engine_check.corruptions docs/engine_check.md"


@pytest.fixture(scope="module")
def bases(request) -> dict[str, Path]:
    return {"w4a4": request.getfixturevalue("demo_w4a4"), "w4a16": request.getfixturevalue("demo_w4a16")}


@pytest.mark.engines
@pytest.mark.slow
@pytest.mark.parametrize("engine", ["sglang", "vllm"])
@pytest.mark.parametrize("case", CATALOGUE, ids=[c.name.replace(" ", "-") for c in CATALOGUE])
def test_corruption_gets_its_catalogued_verdict(case, engine, bases, tmp_path, request):
    request.getfixturevalue(f"{engine}_installed")
    folder = tmp_path / "ckpt"
    shutil.copytree(bases[case.base], folder, ignore=shutil.ignore_patterns("reports"))
    case.apply(folder)
    expect = case.expected[engine]
    if expect.outcome is Outcome.REFUSED:
        with pytest.raises(CheckpointError) as e:
            check_engine(folder, engine, device="cpu", report_dir=tmp_path / "reports")
        assert expect.signal in str(e.value)
        return
    report = check_engine(folder, engine, device="cpu", report_dir=tmp_path / "reports")
    assert (tmp_path / "reports" / f"engine_check_{engine}.json").is_file()  # a verdict is always written
    if expect.outcome is Outcome.PASS:
        assert report.passed, report.misses
        return
    assert not report.passed
    assert any(expect.signal in m for m in report.misses), (expect.signal, report.misses)
