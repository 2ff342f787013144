"""serve-check replays recorded traffic (issue #27): arrival order and times from the dump, prompts as recorded,
output lengths as recorded, bounded concurrency, against the in-process reference server on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

from kimi_nvfp4.data.errors import DataError
from kimi_nvfp4.data.loaders import load_data_spec
from kimi_nvfp4.serve_check.api import run_serve_check
from kimi_nvfp4.serve_check.client import ChatResult
from kimi_nvfp4.serve_check.replay import ReplayConfig, build_plan, load_plan, replay, run_replay
from kimi_nvfp4.serve_check.report import QualityConfig

sys.path.insert(0, str(Path(__file__).parents[1] / "data"))
from traffic_fixtures import entry, write_dump  # noqa: E402

# (arrival offset s, prompt ids, output ids): written out of arrival order, over two dump files
RECORDS = [(7.0, [10, 11, 12, 13], [40, 41, 42]), (0.0, [20, 21, 22], [43]), (3.0, [30, 31, 32, 33, 34], [44, 45]),
           (2.0, [50, 51], [46, 47, 48, 49]), (8.0, [60, 61, 62], [70, 71, 72, 73, 74])]
TEXT = "<|im_end|>recorded text prompt"


def _dump(folder: Path) -> str:
    entries = [entry(ids, out, t=t) for t, ids, out in RECORDS]
    write_dump(folder / "2026-01-01_12-00-00.pkl", entries[:3])
    write_dump(folder / "2026-01-01_12-05-00.pkl", [*entries[3:], entry(text=TEXT, output_ids=None, t=9.0,
                                                                         finish="abort")])
    return f"sglang-dump:{folder}"


def _recording(engine) -> list[list[int]]:
    """The prompts the engine was started on, in order (the server runs one request at a time)."""
    seen: list[list[int]] = []
    start = engine.start

    def recorded(prompt_ids, params, should_stop=None):
        seen.append(list(prompt_ids))
        return start(prompt_ids, params, should_stop)

    engine.start = recorded
    return seen


def test_replay_sends_the_recorded_prompts_in_arrival_order(scripted_server, tmp_path):
    url, engine = scripted_server()
    sent = _recording(engine)
    spec = _dump(tmp_path / "dumps")
    report = run_replay(url, ReplayConfig(data=spec, speed=50, concurrency=1), label="ref", progress=False)
    by_arrival = sorted(RECORDS)
    assert report.recorded_requests == report.replayed == 6 and report.point.errors == 0
    assert sent == [ids for _, ids, _ in by_arrival] + [engine.encode(TEXT)]  # ids verbatim, text tokenized there
    # finished requests generate their recorded output length; the aborted one its recorded max_new_tokens (8)
    assert [r.completion_tokens for r in report.requests] == [len(out) for _, _, out in by_arrival] + [8]
    assert [r.index for r in report.requests] == list(range(6))
    # the schedule is the recorded arrival offsets over the speed; nothing is sent before its time
    assert [r.scheduled_s for r in report.requests] == pytest.approx([t / 50 for t, _, _ in by_arrival] + [9 / 50])
    assert all(r.sent_s >= r.scheduled_s - 1e-3 for r in report.requests)
    assert report.recorded_span_s == pytest.approx(9.0) and report.scheduled_span_s == pytest.approx(9 / 50)
    assert report.latency_p50_s is not None and report.recorded_latency_p50_s == pytest.approx(1.0)


def test_inter_arrival_gaps_scale_with_the_speed(tmp_path):
    spec = _dump(tmp_path / "dumps")
    requests = [r for result in load_data_spec(spec) for r in result.requests]
    gaps = {}
    for speed in (1.0, 10.0, 1440.0):
        times = [i.scheduled_s for i in build_plan(requests, ReplayConfig(data=spec, speed=speed))]
        gaps[speed] = [b - a for a, b in zip(times, times[1:])]
    assert gaps[1.0] == pytest.approx([2.0, 1.0, 4.0, 1.0, 1.0])
    assert gaps[10.0] == pytest.approx([g / 10 for g in gaps[1.0]])
    assert gaps[1440.0] == pytest.approx([g / 1440 for g in gaps[1.0]])
    limited = build_plan(requests, ReplayConfig(data=spec, limit=2))
    assert [i.input_ids for i in limited] == [[20, 21, 22], [50, 51]]


class _SlowClient:
    """Counts requests in flight; each takes 20 ms."""

    def __init__(self):
        self.in_flight = self.most = 0

    async def generate(self, *, input_ids=None, text=None, max_new_tokens, ignore_eos=False):
        self.in_flight += 1
        self.most = max(self.most, self.in_flight)
        await asyncio.sleep(0.02)
        self.in_flight -= 1
        return ChatResult(ok=True, latency_s=0.02, completion_tokens=max_new_tokens, usage_reported=True)


def test_concurrency_is_bounded_and_waiting_shows_as_lateness(tmp_path):
    spec = _dump(tmp_path / "dumps")
    plan, _ = load_plan(ReplayConfig(data=spec))
    burst = [type(i)(**{**i.__dict__, "scheduled_s": 0.0}) for i in plan * 3]  # 18 requests due at once
    burst = [type(i)(**{**i.__dict__, "index": k}) for k, i in enumerate(burst)]
    client = _SlowClient()
    done, too_long, _, timed_out = asyncio.run(replay(client, burst, ReplayConfig(data=spec, concurrency=3)))
    assert len(done) == 18 and not too_long and not timed_out
    assert client.most == 3
    assert max(sent for sent, _ in done.values()) >= 0.02 * (18 // 3 - 1)  # later ones waited for a slot


def test_sessions_without_recorded_requests_are_refused(tmp_path):
    with pytest.raises(DataError, match="no recorded requests to replay"):
        load_plan(ReplayConfig(data="sample"))


def test_serve_check_replay_reports_and_gates_without_prompt_content(scripted_server, tmp_path):
    url, _ = scripted_server()
    spec = _dump(tmp_path / "dumps")
    report = run_serve_check(tmp_path, url=url, report_dir=tmp_path / "rep", load=None, progress=False,
                             replay=ReplayConfig(data=spec, speed=100, concurrency=2),
                             quality=QualityConfig(humaneval=False, tool_calls=False, agreement=False))
    assert report.passed and report.replay is not None and report.replay.replayed == 6
    assert [g.name for g in report.gates] == ["replay error rate"]
    md = (tmp_path / "rep" / "serve_check.md").read_text()
    assert "## Replay" in md and "replayed at 100x" in md
    written = (tmp_path / "rep" / "serve_check.json").read_text() + md
    for _, ids, _ in RECORDS:  # counts and timings only
        assert json.dumps(ids)[1:-1] not in written
    assert "recorded text prompt" not in written


def test_cli_replay_replaces_the_synthetic_sweep(scripted_server, tmp_path):
    from click.testing import CliRunner

    from kimi_nvfp4.serve_check.cli import serve_check_command

    url, _ = scripted_server()
    spec = _dump(tmp_path / "dumps")
    res = CliRunner().invoke(serve_check_command, [
        str(tmp_path), "--url", url, "--report", str(tmp_path / "r"), "--replay", spec, "--replay-speed", "100",
        "--replay-concurrency", "2", "--no-agreement", "--no-humaneval", "--no-tool-calls", "--no-progress"])
    assert res.exit_code == 0, res.output
    saved = json.loads((tmp_path / "r" / "serve_check.json").read_text())
    assert saved["load"] is None and saved["replay"]["replayed"] == 6 and saved["replay"]["speed"] == 100
