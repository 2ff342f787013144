"""bench/profile/rehearsal.py end to end on the tiny preset, CPU: every stage through the CLI, the per-layer costs read
back from the stage reports, the result file written; and the K2.6 projection's arithmetic."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:  # bench/ lives beside the package, not inside it
    sys.path.insert(0, str(REPO_ROOT))

from bench.profile import rehearsal  # noqa: E402


def test_projection_is_60_moe_layers_plus_the_dense_one():
    p = rehearsal.projection([2.0, 10.0, 12.0, 11.0], [False, True, True, True], stage_seconds=40.0)
    assert p["projection"] is True
    assert p["k26_layers_seconds"] == 11.0 * 60 + 2.0
    assert p["non_layer_seconds_measured"] == 5.0
    assert rehearsal.projection([2.0], [False]) is None  # no measured MoE layer: no projection


@pytest.mark.slow
def test_tiny_rehearsal_on_cpu(tmp_path, monkeypatch):
    result = tmp_path / "r.json"
    tiny = "--samples 2 --seq-len 32 --resume-every 0"
    monkeypatch.setenv("PYTHONPATH", str(REPO_ROOT))  # the stages' subprocesses import kimi_nvfp4 from this tree
    monkeypatch.setattr(sys, "argv", [
        "rehearsal", "--preset", "tiny", "--layers", "3", "--experts", "4", "--source-dir", str(tmp_path / "src"),
        "--work-dir", str(tmp_path / "work"), "--device", "cpu", "--synth-workers", "1", "--data", "sample",
        "--calibrate-args", tiny, "--validate-args", tiny, "--disk-gib", "0.0625", "--disk-writers", "1",
        "--json", str(result)])
    record = rehearsal.main()
    written = json.loads(result.read_text())
    assert written["stages"].keys() == {"synth", "convert", "calibrate", "validate"}
    for stage in ("synth", "convert", "calibrate"):
        assert written["stages"][stage]["exit_code"] == 0, written["stages"][stage].get("stderr_tail")
    assert written["stages"]["validate"]["exit_code"] in (0, 1)  # 1: a gate failed, still a finished run
    assert written["stages"]["convert"]["summary"]["shards_total"] > 0
    for stage in ("calibrate", "validate"):
        rep = written["stages"][stage]["report"]
        assert len(rep["layer_seconds"]) == len(rep["layer_host_peak_rss_bytes"]) == 3
        assert rep["layer_gpu_peak_bytes"] is None  # CPU
        assert rep["memory_plan"]["device"] == "cpu"
        assert written["stages"][stage]["child_peak_rss_bytes"] > 0
        assert "projection_k26_depth" not in rep  # a tiny model projects nothing for K2.6
    assert written["source_bytes"] > 0 and written["output_bytes"] > 0
    assert written["disk_write_rate"]["rows"][0]["bytes"] > 0
    assert not (tmp_path / "work" / "out").exists()  # deleted without --keep
    assert (tmp_path / "src" / "tiny_3l_4e").is_dir()  # kept: it is in --source-dir
    assert record["stages"]["calibrate"]["exit_code"] == 0

    # a second run reuses the finished source; a convert that fails stops the run, recorded with its stderr
    result.unlink()
    argv = sys.argv[:]
    monkeypatch.setattr(sys, "argv", argv + ["--convert-args=--no-such-option"])
    rehearsal.main()
    again = json.loads(result.read_text())
    assert "skipped" in again["stages"]["synth"]
    assert again["stages"]["convert"]["exit_code"] == 2 and again["stages"]["convert"]["stderr_tail"]
    assert again["stages"].keys() == {"synth", "convert"}


def test_a_stage_past_its_timeout_is_recorded(tmp_path):
    entry = rehearsal.run_stage("sleep", [sys.executable, "-c", "import time; time.sleep(30)"], 1.0, tmp_path)
    assert entry["timed_out"] is True and entry["exit_code"] is None and entry["wall_s"] < 20
    failed = rehearsal.run_stage("fail", [sys.executable, "-c", "import sys; sys.exit('boom')"], 30.0, tmp_path)
    assert failed["exit_code"] == 1 and failed["stderr_tail"] == ["boom"]


def test_the_rehearsal_restores_the_callers_sigterm_handler(monkeypatch):
    """Its SIGTERM handler (stop the stage, write what finished) lives only while it runs: a test process or any
    caller importing and running it keeps its own afterwards (a leaked handler once turned pytest's SIGTERM into
    the rehearsal's exception)."""
    import signal

    before = signal.getsignal(signal.SIGTERM)
    monkeypatch.setattr(rehearsal, "_main", lambda: {"ran": True})
    assert rehearsal.main() == {"ran": True}
    assert signal.getsignal(signal.SIGTERM) is before
