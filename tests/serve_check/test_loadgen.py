import pytest

from kimi_nvfp4.serve_check.client import ChatResult
from kimi_nvfp4.serve_check.loadgen import percentile, run_sweep, summarise_point
from kimi_nvfp4.serve_check.workload import AgentSession, LoadConfig, LoadTooLarge, session_shape


def test_percentile_matches_linear_interpolation():
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile(list(range(101)), 99) == pytest.approx(99.0)


def test_summarise_point_metrics():
    ok = ChatResult(ok=True, ttft_s=0.5, latency_s=1.5, prompt_tokens=900, completion_tokens=11, cached_tokens=800,
                    usage_reported=True)
    bad = ChatResult(ok=False, error="HTTP 500: boom")
    p = summarise_point(2, [ok, ok, bad], duration_s=60.0, num_gpus=4, timed_out=False)
    assert p.requests == 3 and p.errors == 1 and p.error_samples == ["HTTP 500: boom"]
    assert p.tpot_p50_ms == pytest.approx(100.0)
    assert p.interactivity_tok_s == pytest.approx(10.0)
    assert p.throughput_tok_min_gpu == pytest.approx((2 * 911) / 1.0 / 4)
    assert p.cache_hit_rate == pytest.approx(800 / 900)
    assert p.ttft_p50_s == 0.5


def test_session_shape_scales_to_context():
    cfg = LoadConfig(turns=30, input_tokens=100_000, output_tokens=500)
    big = session_shape(cfg, None)
    assert big.first_context_tokens == 50_000 and big.tool_result_tokens == 3333
    small = session_shape(cfg, 131072)
    assert small.last_prompt_tokens + 500 <= 0.9 * 131072
    assert small.first_context_tokens < 50_000 and small.output_tokens == 500
    with pytest.raises(LoadTooLarge, match="do not fit"):
        session_shape(LoadConfig(turns=30, output_tokens=500), 8192)


def test_agent_session_grows_with_kimi_tool_ids():
    shape = session_shape(LoadConfig(turns=3, input_tokens=400, output_tokens=4), None)
    s = AgentSession(shape, 3.5, seed=1, session_id="x")
    n0 = len(str(s.messages))
    s.add_reply_and_tool_result("ok")
    assert s.messages[-2]["tool_calls"][0]["id"] == "functions.read_file:0"
    assert s.messages[-1]["tool_call_id"] == "functions.read_file:0"
    assert len(str(s.messages)) > n0
    again = AgentSession(shape, 3.5, seed=1, session_id="x")
    assert again.messages == s.messages[:2]  # deterministic by seed
    # the server counts 1 token per character: later tool results shrink to match their token size
    chars = sum(len(m["content"]) for m in s.messages)
    s.observe_prompt_tokens(chars)
    s.add_reply_and_tool_result("ok")
    assert len(s.messages[-1]["content"]) == shape.tool_result_tokens


def test_closed_loop_sweep_against_reference_server(scripted_server):
    url, engine = scripted_server()
    cfg = LoadConfig.quick(concurrency=[1, 3], turns=3, input_tokens=200, output_tokens=4)
    sweep = run_sweep(url, cfg, label="ref", num_gpus=1, progress=False)
    assert [p.concurrency for p in sweep.points] == [1, 3]
    for p in sweep.points:
        assert p.errors == 0 and p.requests == p.concurrency * 3 and not p.timed_out
        assert p.mean_completion_tokens == 4
        # turns 2 and 3 reuse the history: hits on at least 2 of 3 requests per session
        assert p.cache_hit_rate > 0.4
        assert p.throughput_tok_min_gpu > 0 and p.interactivity_tok_s > 0
    assert engine.prefix_cache.stats.lookups == 1 * 3 + 3 * 3


def test_point_timeout_bounds_the_run(scripted_server):
    url, _ = scripted_server()
    cfg = LoadConfig.quick(concurrency=[2], turns=50, tool_gap_s=0.2, point_timeout_s=0.5, input_tokens=100,
                           output_tokens=2)
    sweep = run_sweep(url, cfg, label="ref", progress=False)
    (p,) = sweep.points
    assert p.timed_out and p.duration_s < 3 and p.requests < 100
