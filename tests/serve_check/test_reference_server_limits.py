"""The reference server cannot be monopolised, and bad requests are named 400s (issue 17)."""

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import aiohttp
import pytest

from kimi_nvfp4.data.chat_template import ChatTemplate
from kimi_nvfp4.serve_check.launcher import ServerLaunchError
from kimi_nvfp4.serve_check.reference_server import ReferenceServer, serve_forever

from .conftest import ScriptedEngine

HERE = Path(__file__).parent
USER = [{"role": "user", "content": "hello"}]


def _post(url: str, body, timeout: float = 30.0) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _chat(url: str, **body) -> tuple[int, dict]:
    return _post(url + "/v1/chat/completions", {"messages": USER, **body})


def _generate(url: str, **body) -> tuple[int, dict]:
    return _post(url + "/generate", body)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/generate"])
@pytest.mark.parametrize("raw, why", [(b"[1, 2]", "JSON object, got a JSON array"), (b"{not json", "not JSON"),
                                      (b'"text"', "JSON object, got a JSON string")])
def test_bodies_that_are_not_objects_are_400s(scripted_server, path, raw, why):
    url, _ = scripted_server()
    status, body = _post(url + path, raw)
    assert status == 400 and why in body["error"]["message"]


@pytest.mark.parametrize("ids, why", [([1, -1], "input_ids[1] = -1"), ([1, 10 ** 6], "input_ids[1] = 1000000"),
                                      ([1, "a"], "input_ids[1] = 'a'"), ([1.5], "input_ids[0] = 1.5"),
                                      ([True], "input_ids[0] = True"), ([], "non-empty"), ("abc", "non-empty")])
def test_bad_token_ids_are_400s(scripted_server, ids, why):
    url, engine = scripted_server()
    status, body = _generate(url, input_ids=ids)
    assert status == 400 and why in body["error"]["message"]
    assert f"[0, {engine.vocab_size})" in body["error"]["message"] or "non-empty" in why


@pytest.mark.parametrize("field, value, why", [
    ("seed", 1.5, "'seed' must be an integer"), ("seed", "7", "'seed' must be an integer"),
    ("seed", 2 ** 64, "'seed' must be in"), ("temperature", -0.5, "temperature must be a non-negative"),
    ("temperature", "hot", "'temperature' must be a finite number"), ("top_p", 0, "top_p must be in (0, 1]"),
    ("top_p", 1.5, "top_p must be in (0, 1]"), ("max_tokens", 0, "'max_tokens' must be at least 1"),
    ("max_tokens", -3, "'max_tokens' must be at least 1"), ("max_completion_tokens", 2.5, "must be an integer"),
    ("stream", "yes", "'stream' must be true or false"), ("messages", [], "'messages' must be a non-empty array"),
    ("messages", ["hi"], "messages[0] must be an object"), ("tools", {"a": 1}, "'tools' must be an array"),
    ("chat_template_kwargs", [1], "'chat_template_kwargs' must be an object"),
])
def test_bad_chat_fields_are_400s(scripted_server, field, value, why):
    url, _ = scripted_server()
    status, body = _chat(url, **{field: value})
    assert status == 400, body
    assert why in body["error"]["message"]


@pytest.mark.parametrize("sp, why", [({"sampling_seed": 0.5}, "'sampling_seed' must be an integer"),
                                     ({"temperature": -1}, "temperature must be a non-negative"),
                                     ({"top_p": 0.0}, "top_p must be in (0, 1]"),
                                     ({"max_new_tokens": -1}, "'max_new_tokens' must be at least 0")])
def test_bad_native_sampling_params_are_400s(scripted_server, sp, why):
    url, _ = scripted_server()
    status, body = _generate(url, input_ids=[1, 2, 3], sampling_params=sp)
    assert status == 400 and why in body["error"]["message"]


def test_token_budgets_follow_sglang(scripted_server):
    url, engine = scripted_server(context_length=200)
    prompt = len(engine.render_chat(USER, None))
    # absent max_tokens: until a stop token or the context is full (SGLang's default), never 256
    status, body = _chat(url, ignore_eos=True, temperature=0)
    assert status == 200 and body["usage"]["completion_tokens"] == 200 - prompt - 1
    # a budget beyond the context is refused with SGLang's message
    status, body = _chat(url, max_tokens=1e9, ignore_eos=True)
    assert status == 400 and "exceeds the model's maximum context length of 200 tokens" in body["error"]["message"]
    # a prompt that fills the context
    status, body = _chat(url, messages=[{"role": "user", "content": "x" * 300}], max_tokens=1)
    assert status == 400 and "is longer than the model's context length (200 tokens)" in body["error"]["message"]
    # native max_new_tokens 0 runs the prompt and returns nothing; default is SGLang's 128
    status, body = _generate(url, input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 0})
    assert status == 200 and body["output_ids"] == [] and body["meta_info"]["completion_tokens"] == 0
    status, body = _generate(url, input_ids=[1, 2, 3], sampling_params={"ignore_eos": True})
    assert status == 200 and len(body["output_ids"]) == 128


def test_the_server_limit_caps_what_a_request_may_generate(scripted_server):
    url, _ = scripted_server(app_options={"max_new_tokens_limit": 7})
    status, body = _chat(url, max_tokens=50, ignore_eos=True)
    assert status == 200 and body["usage"]["completion_tokens"] == 7
    info = json.loads(urllib.request.urlopen(url + "/get_server_info", timeout=10).read())
    assert info["max_new_tokens_limit"] == 7


def test_server_info_reports_an_empty_prefix_cache(scripted_server):
    url, _ = scripted_server()
    info = json.loads(urllib.request.urlopen(url + "/get_server_info", timeout=10).read())
    assert info["prefix_cache"] == {"cached_tokens": 0, "snapshots": 0, "hit_rate": None} or \
        info["prefix_cache"]["snapshots"] == 0
    assert info["prefix_cache"] is not None and info["max_queued_requests"] >= 1


def _stream_until_first_chunk(url: str, body: dict) -> tuple[socket.socket, bytes]:
    """Open a streaming chat request by hand and return the socket once the first token arrived."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    payload = json.dumps({"messages": USER, "stream": True, **body}).encode()
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
    seen = b""
    deadline = time.monotonic() + 60
    while b'"reasoning_content": "' not in seen and b'"content": "' not in seen.replace(b'"content": ""', b""):
        chunk = sock.recv(4096)
        assert chunk, "server closed the stream"
        assert time.monotonic() < deadline, "no token streamed within 60 s"
        seen += chunk
    return sock, seen


# Bounds below are counted in engine progress (tokens generated, renders begun and ended), never in wall seconds:
# this machine is shared, and a slow event loop must not fail a test whose order of events is right.
ABANDONED_TOKENS = 5000


class RecordingEngine(ScriptedEngine):
    """The scripted engine, keeping every generation's stream so a test can count the tokens it produced."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.streams = []

    def start(self, prompt_ids, params, should_stop=None):
        stream = super().start(prompt_ids, params, should_stop)
        self.streams.append(stream)
        return stream


def _assert_stopped_early(stream) -> None:
    """The abandoned generation ended (its token count no longer grows once a later request was served) far short
    of what it asked for."""
    produced = len(stream.output_ids)
    assert produced < ABANDONED_TOKENS // 2, f"the abandoned request ran on: {produced} tokens"


def test_a_full_queue_is_a_503_and_a_gone_client_frees_the_engine():
    engine = RecordingEngine(token_delay_s=0.01)
    with ReferenceServer(engine, max_pending=1) as server:
        url = server.base_url
        sock, _ = _stream_until_first_chunk(url, {"max_tokens": ABANDONED_TOKENS, "ignore_eos": True})
        status, body = _chat(url, max_tokens=1)
        assert status == 503 and "The request queue is full" in body["error"]["message"]
        sock.close()  # the client goes away mid-generation: the request stops at its next token
        # the queue frees only when the abandoned generation stops, so the first 200 comes after it did
        while (status := _chat(url, max_tokens=3, ignore_eos=True)[0]) != 200:
            assert status == 503
            _assert_stopped_early(engine.streams[0])  # still running: but never for its whole budget
            time.sleep(0.05)
        _assert_stopped_early(engine.streams[0])


def test_a_non_streaming_client_that_gives_up_cancels_its_request():
    engine = RecordingEngine(token_delay_s=0.01)
    with ReferenceServer(engine) as server:
        url = server.base_url

        async def give_up():
            timeout = aiohttp.ClientTimeout(total=0.5)
            async with aiohttp.ClientSession(timeout=timeout) as s:
                with pytest.raises(asyncio.TimeoutError):
                    await s.post(url + "/v1/chat/completions",
                                 json={"messages": USER, "max_tokens": ABANDONED_TOKENS, "ignore_eos": True})
        asyncio.run(give_up())
        status, _ = _chat(url, max_tokens=2, ignore_eos=True)
        assert status == 200 and len(engine.streams) == 2
        _assert_stopped_early(engine.streams[0])


BOMB = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"


class BombEngine(ScriptedEngine):
    def __init__(self):
        super().__init__()
        self.rendering, self.rendered = threading.Event(), threading.Event()

    def render_chat(self, messages, tools, **template_kwargs):
        self.rendering.set()
        try:
            return self.encode(ChatTemplate(BOMB, "bomb.jinja", time_budget_s=2.0).render(messages))
        finally:
            self.rendered.set()


def test_a_template_bomb_is_a_400_and_the_event_loop_stays_free():
    """/health is answered while the bomb is still rendering: the render does not hold the event loop (an order of
    events, whatever this machine's speed)."""
    engine = BombEngine()
    with ReferenceServer(engine) as server:
        result = {}
        worker = threading.Thread(target=lambda: result.update(r=_chat(server.base_url, max_tokens=1)))
        worker.start()
        assert engine.rendering.wait(60), "the bomb never started rendering"
        with urllib.request.urlopen(server.base_url + "/health", timeout=60) as r:
            assert r.status == 200
        assert not engine.rendered.is_set(), "/health waited for the render"
        worker.join(60)
        status, body = result["r"]
        assert status == 400 and "ran longer than 2 s" in body["error"]["message"]


def test_a_busy_port_is_a_named_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(ServerLaunchError, match=f"port {port} on 127.0.0.1 is already in use"):
            serve_forever(ScriptedEngine(), "127.0.0.1", port)
        with pytest.raises(ServerLaunchError, match="already in use"):
            ReferenceServer(ScriptedEngine(), port=port).start()


CHILD = """
import sys
sys.path.insert(0, {tests!r})
from serve_check.conftest import ScriptedEngine
from kimi_nvfp4.serve_check.reference_server import serve_forever
serve_forever(ScriptedEngine(token_delay_s=0.02), "127.0.0.1", {port})
print("clean exit", flush=True)
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signals_stop_the_server_while_a_request_runs(sig):
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parents[1]), os.environ.get("PYTHONPATH", "")])}
    child = subprocess.Popen([sys.executable, "-c", CHILD.format(tests=str(HERE.parent), port=port)],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(url + "/health", timeout=2)
                break
            except OSError:
                assert child.poll() is None and time.monotonic() < deadline, child.stdout.read()
                time.sleep(0.1)
        sock, _ = _stream_until_first_chunk(url, {"max_tokens": 50000, "ignore_eos": True})
        child.send_signal(sig)
        rc = child.wait(timeout=15)  # 50000 tokens x 20 ms would be 1000 s
        out = child.stdout.read()
        assert rc == 0 and "clean exit" in out, out
        sock.close()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
