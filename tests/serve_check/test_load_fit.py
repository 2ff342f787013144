"""serve-check measures the reference emulator and projects its work before sending it."""

import pytest

from kimi_nvfp4.serve_check.load_fit import (EngineSpeed, LoadTooLarge, check_reference_fit, measure_speed,
                                             project_load_s, project_quality_s)
from kimi_nvfp4.serve_check.report import QualityConfig
from kimi_nvfp4.serve_check.workload import LoadConfig, SessionShape


def test_projection_adds_every_request_one_after_another():
    speed = EngineSpeed(prefill_s_per_token=0.001, decode_s_per_token=0.01)
    cfg = LoadConfig(concurrency=[1, 2], turns=3, sessions_per_user=2)
    shape = SessionShape(first_context_tokens=1000, tool_result_tokens=100, output_tokens=10, turns=3)
    session = (1000 * 0.001 + 10 * 0.01) + 2 * ((100 + 32) * 0.001 + 10 * 0.01)
    assert project_load_s(cfg, shape, speed) == pytest.approx(3 * 2 * session)
    quick = QualityConfig.quick()
    expected = 4 * (400 * 0.001 + 64 * 0.01) + 4 * (400 * 0.001 + 64 * 0.01) + 3 * (400 * 0.001 + 16 * 0.01)
    assert project_quality_s(quick, speed) == pytest.approx(expected)


def test_the_probe_measures_decode_speed(scripted_server):
    url, engine = scripted_server(token_delay_s=0.01)
    speed = measure_speed(url, engine.vocab_size, engine.context_length)
    assert 0.005 < speed.decode_s_per_token < 0.1


def test_default_load_is_refused_and_quick_is_allowed_on_a_slow_emulator(scripted_server):
    url, engine = scripted_server(token_delay_s=0.005)
    info = {"context_length": engine.context_length, "vocab_size": engine.vocab_size}
    with pytest.raises(LoadTooLarge) as e:
        check_reference_fit(url, info, LoadConfig(), QualityConfig())
    message = str(e.value)
    assert "7 points up to 32 users, 30 turns" in message and "--quick" in message
    assert check_reference_fit(url, info, LoadConfig.quick(), QualityConfig.quick()) < 20 * 60


def test_servers_that_do_not_say_their_size_are_not_probed():
    assert check_reference_fit("http://127.0.0.1:9", {}, LoadConfig(), QualityConfig()) == 0.0
