"""bench/harness/prepared.py: the experiments' timed, reusable checkpoint folders."""

from __future__ import annotations

from pathlib import Path

from bench.harness.prepared import PreparedFolders


def _make(work: Path, name: str, marker: str = "done") -> Path:
    (work / name).mkdir(exist_ok=True)
    (work / name / marker).write_text("x")
    return work / name


def test_folders_are_made_and_timed_and_reused_only_when_asked(tmp_path):
    made = PreparedFolders()
    assert made("a", _make, tmp_path, "a") == tmp_path / "a"
    assert made.seconds["a"] >= 0
    calls = []
    reuse = PreparedFolders(lambda folder: (folder / "done").is_file())
    assert reuse("a", lambda *a: calls.append(a), tmp_path, "a") == tmp_path / "a"
    assert calls == [] and reuse.seconds == {"a": None}  # finished: taken as it is
    assert reuse("b", _make, tmp_path, "b") == tmp_path / "b" and reuse.seconds["b"] is not None
    assert reuse("c", lambda: tmp_path / "c") == tmp_path / "c"  # no (work, name): never reused
