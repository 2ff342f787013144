"""The reference server on the real emulator: a tiny synthetic K2.6 checkpoint converted to NVFP4."""

import asyncio

import pytest
import torch

from kimi_nvfp4.checkpoint.manifest import load_manifest
from kimi_nvfp4.model import K2Model, open_weights
from kimi_nvfp4.serve_check.api import run_serve_check
from kimi_nvfp4.serve_check.client import ChatClient
from kimi_nvfp4.serve_check.engine import EmulatorEngine, SamplingParams
from kimi_nvfp4.serve_check.quality.agreement import run_agreement_check
from kimi_nvfp4.serve_check.reference_server import ReferenceServer
from kimi_nvfp4.serve_check.report import QualityConfig
from kimi_nvfp4.serve_check.workload import LoadConfig

# the synthetic checkpoint is not calibrated (no input_scale): emulate Hopper's weight-only path
ACTIVATIONS = "w4a16"


@pytest.fixture(scope="module")
def nvfp4_checkpoint(tmp_path_factory):
    from kimi_nvfp4.convert.api import convert_checkpoint
    from kimi_nvfp4.synth import create_synthetic_checkpoint

    root = tmp_path_factory.mktemp("serve_emulator")
    src = create_synthetic_checkpoint(root / "src", preset="tiny")
    convert_checkpoint(src, root / "nvfp4", progress=False)
    return root / "nvfp4"


@pytest.fixture(scope="module")
def engine(nvfp4_checkpoint):
    return EmulatorEngine(nvfp4_checkpoint, activations=ACTIVATIONS)


@pytest.fixture(scope="module")
def server(engine):
    with ReferenceServer(engine) as s:
        yield s


def test_engine_streams_what_k2model_generates_and_reuses_the_prefix(engine, nvfp4_checkpoint):
    ids = engine.render_chat([{"role": "user", "content": "def add(a, b):"}], None)
    first = list(engine.start(ids, SamplingParams(max_new_tokens=6, ignore_eos=True)))
    model = K2Model(open_weights(nvfp4_checkpoint, kind="nvfp4", activations=ACTIVATIONS))
    expected = model.generate(ids, 6)
    assert [e.token_id for e in first] == expected.token_ids
    assert [e.logprob for e in first] == pytest.approx(expected.logprobs, abs=1e-5)
    again = engine.start(ids, SamplingParams(max_new_tokens=6, ignore_eos=True))
    assert again.cached_tokens == len(ids) - 1
    assert [e.token_id for e in again] == expected.token_ids


def test_long_prompts_are_prefilled_in_chunks_that_can_be_stopped(nvfp4_checkpoint, monkeypatch):
    """Chunked prefill gives the same tokens; a stop request between chunks ends it without output."""
    from kimi_nvfp4.serve_check import engine as engine_module

    fresh = EmulatorEngine(nvfp4_checkpoint, activations=ACTIVATIONS)
    ids = fresh.render_chat([{"role": "user", "content": "def add(a, b):\n    return a + b\n" * 4}], None)
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    whole = list(fresh.start(ids, params))
    monkeypatch.setattr(engine_module, "PREFILL_CHUNK_TOKENS", 8)
    calls = []
    chunked_engine = EmulatorEngine(nvfp4_checkpoint, activations=ACTIVATIONS)
    forward = chunked_engine._forward
    chunked_engine._forward = lambda chunk, cache: (calls.append(len(chunk)), forward(chunk, cache))[1]
    chunked = list(chunked_engine.start(ids, params))
    assert [e.token_id for e in chunked] == [e.token_id for e in whole]
    assert [e.logprob for e in chunked] == pytest.approx([e.logprob for e in whole], abs=1e-4)
    assert max(calls) == 8 and sum(calls[:-3]) == len(ids)  # the prompt in chunks, then 3 decode steps
    asked = []
    uncached = list(reversed(ids))
    stopped = chunked_engine.start(uncached, params, should_stop=lambda: asked.append(1) or len(asked) > 2)
    assert list(stopped) == [] and stopped.finish_reason == "abort" and len(asked) == 3


def test_agreement_with_itself_is_exact(server, nvfp4_checkpoint):
    async def main():
        async with ChatClient(server.base_url) as c:
            return await run_agreement_check(c, nvfp4_checkpoint, activations=ACTIVATIONS, max_new_tokens=4, limit=2)
    rep = asyncio.run(main())
    assert rep.prompts == 2 and rep.tokens == 8
    assert rep.agreement == 1.0 and rep.max_abs_logprob_diff < 1e-3


class GateUpSwapped:
    """A weight source that hands out every routed expert with gate and up exchanged (a loading bug)."""

    def __init__(self, source):
        self._source = source
        self.config = source.config

    def __getattr__(self, name):
        return getattr(self._source, name)

    def layer(self, i, device, dtype=torch.float32):
        w = self._source.layer(i, device, dtype)
        for e in getattr(w.mlp, "experts", []):
            e.gate_proj, e.up_proj = e.up_proj, e.gate_proj
        return w


def test_gate_up_mixup_is_caught(server, nvfp4_checkpoint, monkeypatch):
    from kimi_nvfp4.model.runner import LayerStreamRunner
    from kimi_nvfp4.serve_check.quality import agreement

    def buggy_reference(checkpoint, sequences, *, activations, device="cpu", progress=False):
        runner = LayerStreamRunner(GateUpSwapped(open_weights(checkpoint, kind="nvfp4", activations=activations)),
                                   progress=False)
        with torch.no_grad():
            return [t.cpu() for t in runner.run([torch.tensor(s) for s in sequences])]

    monkeypatch.setattr(agreement, "reference_logits", buggy_reference)

    async def main():
        async with ChatClient(server.base_url) as c:
            return await run_agreement_check(c, nvfp4_checkpoint, activations=ACTIVATIONS, max_new_tokens=4, limit=2)
    rep = asyncio.run(main())
    assert rep.mean_abs_logprob_diff > 1e-3


@pytest.mark.slow
def test_quick_serve_check_end_to_end(server, nvfp4_checkpoint, tmp_path):
    report = run_serve_check(
        nvfp4_checkpoint, url=server.base_url, report_dir=tmp_path, progress=False,
        load=LoadConfig.quick(concurrency=[1, 2], turns=2, input_tokens=120, output_tokens=3),
        quality=QualityConfig.quick(humaneval_limit=1, tool_call_limit=1, agreement_limit=1,
                                    agreement_max_new_tokens=3, humaneval_max_tokens=4, tool_call_max_tokens=4),
    )
    assert report.passed, report.failed_gates()
    assert report.quality.agreement.activations == ACTIVATIONS and report.quality.agreement.agreement == 1.0
    hits = [p.cache_hit_rate for p in report.load.points]
    assert all(h is not None and h > 0.3 for h in hits)
    assert (tmp_path / "serve_check.png").exists()
    record = load_manifest(nvfp4_checkpoint).stages["serve_check"]
    assert record.complete and record.outputs["passed"] is True and record.settings["server"] == server.base_url


@pytest.mark.slow
def test_serve_reference_command_as_a_managed_subprocess(nvfp4_checkpoint, tmp_path):
    """`kimi-nvfp4 serve-reference` in its own process, started and torn down by the SGLang launcher code."""
    import json
    import socket
    import sys
    import urllib.request

    from kimi_nvfp4.serve_check.launcher import ManagedServer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-c", "from kimi_nvfp4.cli import main; main()", "serve-reference", str(nvfp4_checkpoint),
           "--port", str(port), "--activations", ACTIVATIONS]
    url = f"http://127.0.0.1:{port}"
    with ManagedServer(cmd, url, tmp_path / "ref.log", ready_timeout_s=120, poll_interval_s=0.2) as server:
        server.wait_ready()
        with urllib.request.urlopen(url + "/get_server_info", timeout=10) as r:
            info = json.loads(r.read())
        assert info["emulated_activations"] == ACTIVATIONS and info["model_path"] == str(nvfp4_checkpoint)
    assert not server.running()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_engine_generates_what_the_cpu_engine_does(engine, nvfp4_checkpoint):
    gpu = EmulatorEngine(nvfp4_checkpoint, activations=ACTIVATIONS, device="cuda")
    ids = engine.render_chat([{"role": "user", "content": "print hello"}], None)
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    cpu_out = list(engine.start(ids, params))
    gpu_out = list(gpu.start(ids, params))
    assert [e.token_id for e in gpu_out] == [e.token_id for e in cpu_out]
    assert [e.logprob for e in gpu_out] == pytest.approx([e.logprob for e in cpu_out], abs=1e-3)


@pytest.mark.parametrize("load, why", [
    (LoadConfig(), "do not fit the server's context of"),  # B200-sized: 30 turns x 500 tokens
    (LoadConfig(turns=5, output_tokens=100), "reference emulator .* would take about .*"),
], ids=["default", "fits-the-context-but-slow"])
def test_serve_check_stops_at_once_when_a_b200_sized_load_meets_the_emulator(server, nvfp4_checkpoint, tmp_path,
                                                                            monkeypatch, load, why):
    """The default load (32 users, 30 turns, 100k-token prompts) would take hours on a CPU emulator."""
    import time

    from kimi_nvfp4.serve_check import load_fit

    monkeypatch.setattr(load_fit, "REFERENCE_BUDGET_S", 60.0)
    start = time.monotonic()
    with pytest.raises(load_fit.LoadTooLarge, match=why + ".*--quick"):
        run_serve_check(nvfp4_checkpoint, url=server.base_url, report_dir=tmp_path, load=load,
                        quality=QualityConfig(), progress=False)
    assert time.monotonic() - start < 60
    assert not (tmp_path / "serve_check.json").exists()
