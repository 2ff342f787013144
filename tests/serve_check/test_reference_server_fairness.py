"""No client holds the reference server (issue 29, injection item 5): each fault reproduced on 127.0.0.1.

Assertions are on the order of events (a short request answered while the long one is still
generating; a connection closed while its generation had far to go), never on wall-clock bounds:
the deadlines below only stop a broken server from hanging the test run.
"""

import json
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

from kimi_nvfp4.serve_check.http_limits import ServerLimits
from kimi_nvfp4.serve_check.reference_server import DEFAULT_MAX_NEW_TOKENS_LIMIT, ReferenceServer

from .conftest import ScriptedEngine

USER = [{"role": "user", "content": "hello"}]
LONG = 200_000  # what the injected client asked for (allowed by a 256k context)
HANG_GUARD_S = 30  # only for a broken server; never reached when it works


class RecordingEngine(ScriptedEngine):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.streams = []

    def start(self, prompt_ids, params, should_stop=None):
        stream = super().start(prompt_ids, params, should_stop)
        self.streams.append(stream)
        return stream


def _post(url: str, body, timeout: float = HANG_GUARD_S) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _connect(url: str, rcvbuf: int | None = None) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket()
    if rcvbuf is not None:  # before connect, so the window the server sees is small
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.settimeout(HANG_GUARD_S)
    sock.connect((host, int(port)))
    return sock


def _send_chat(sock: socket.socket, body: dict) -> None:
    payload = json.dumps({"messages": USER, **body}).encode()
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)


def _read_to_eof(sock: socket.socket) -> bytes:
    """Everything until the server closes (bounded by the socket timeout)."""
    seen = b""
    try:
        while chunk := sock.recv(1 << 16):
            seen += chunk
    except ConnectionResetError:  # an aborted connection: also closed
        pass
    return seen


def _wait_for(cond, what: str) -> None:
    deadline = time.monotonic() + HANG_GUARD_S
    while not cond():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.01)


def test_a_short_request_is_answered_while_a_long_one_runs():
    """max_tokens 200000 + ignore_eos on one connection no longer blocks the next request."""
    engine = RecordingEngine(token_delay_s=0.001, context_length=1 << 18)
    with ReferenceServer(engine, max_new_tokens_limit=None) as server:
        long_sock = _connect(server.base_url)
        _send_chat(long_sock, {"max_tokens": LONG, "ignore_eos": True, "stream": True})
        _wait_for(lambda: engine.streams and len(engine.streams[0].output_ids) > 0, "the long request started")
        status, body = _post(server.base_url + "/v1/chat/completions",
                             {"messages": USER, "max_tokens": 3, "ignore_eos": True})
        assert status == 200 and body["usage"]["completion_tokens"] == 3
        long_so_far = len(engine.streams[0].output_ids)
        assert long_so_far < LONG, "the short request waited for the long one to finish"
        long_sock.close()  # the long client leaves: its generation stops at its next step
        _wait_for(lambda: server.app.runner.scheduler.pending == 0, "the long request stopped")
        assert len(engine.streams[0].output_ids) < LONG


def test_requests_are_capped_by_default_below_the_context():
    engine = ScriptedEngine(context_length=1 << 18)
    with ReferenceServer(engine) as server:
        status, body = _post(server.base_url + "/v1/chat/completions",
                             {"messages": USER, "max_tokens": LONG, "ignore_eos": True})
        assert status == 200
        assert body["usage"]["completion_tokens"] == DEFAULT_MAX_NEW_TOKENS_LIMIT < engine.context_length
        assert body["choices"][0]["finish_reason"] == "length"
        info = json.loads(urllib.request.urlopen(server.base_url + "/get_server_info", timeout=HANG_GUARD_S).read())
        assert info["max_new_tokens_limit"] == DEFAULT_MAX_NEW_TOKENS_LIMIT
        assert info["generation_time_budget_s"] > 0 and info["max_running_requests"] >= 1


def test_a_generation_past_its_time_budget_ends_as_length():
    engine = RecordingEngine(token_delay_s=0.002, context_length=1 << 18)
    with ReferenceServer(engine, max_new_tokens_limit=None, time_budget_s=0.2) as server:
        status, body = _post(server.base_url + "/v1/chat/completions",
                             {"messages": USER, "max_tokens": LONG, "ignore_eos": True})
        assert status == 200 and body["choices"][0]["finish_reason"] == "length"
        assert 0 < body["usage"]["completion_tokens"] < LONG


def test_a_streaming_client_that_never_reads_is_closed_and_frees_the_server():
    engine = RecordingEngine(context_length=1 << 18)  # no delay: the stream outruns the socket buffers at once
    limits = ServerLimits(write_timeout_s=0.3, stream_buffer_bytes=16 * 1024)
    with ReferenceServer(engine, max_new_tokens_limit=None, limits=limits) as server:
        sock = _connect(server.base_url, rcvbuf=4096)
        _send_chat(sock, {"max_tokens": LONG, "ignore_eos": True, "stream": True})
        _wait_for(lambda: engine.streams, "the stream started")
        # meanwhile another client is served
        status, _ = _post(server.base_url + "/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}})
        assert status == 200
        # the non-reader's write times out: its connection is aborted and its generation stops
        _wait_for(lambda: server.app.runner.scheduler.pending == 0, "the non-reader's generation stopped")
        produced = len(engine.streams[0].output_ids)
        assert produced < LONG
        seen = _read_to_eof(sock)
        assert b"data: [DONE]" not in seen, "the stream was not cut"
        sock.close()


def test_a_stalled_request_head_or_body_closes_the_socket():
    limits = ServerLimits(header_timeout_s=0.3, body_timeout_s=0.3, linger_s=0.1)
    with ReferenceServer(ScriptedEngine(), limits=limits) as server:
        head = _connect(server.base_url)
        head.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\n")  # and never the rest of the head
        assert _read_to_eof(head) == b""
        head.close()
        body = _connect(server.base_url)
        body.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"input_ids\"")
        reply = _read_to_eof(body)
        assert reply.startswith(b"HTTP/1.1 408") and b"did not arrive within 0.3 s" in reply
        body.close()
        # the server still answers
        assert _post(server.base_url + "/generate", {"input_ids": [1, 2]})[0] == 200


@pytest.mark.parametrize("raw, why", [
    (b'{"input_ids": [1], "text": "\xff\xfe"}', "not valid UTF-8"),
    (b'{"text": "\\ud800 lone"}', "lone UTF-16 surrogate"),
    (b'{"\\udfff": 1, "text": "a"}', "lone UTF-16 surrogate"),
    (b"[" * 100_000, "nested too deeply"),
])
def test_bad_text_is_a_400(scripted_server, raw, why):
    url, _ = scripted_server()
    for path in ("/generate", "/v1/chat/completions"):
        status, body = _post(url + path, raw)
        assert status == 400 and why in body["error"]["message"], body


def test_a_huge_body_is_a_413_before_it_is_read():
    """A declared 300 MB body is refused from its head: the test sends 10 bytes of it, never the rest."""
    with ReferenceServer(ScriptedEngine(), limits=ServerLimits(linger_s=0.1)) as server:
        sock = _connect(server.base_url)
        sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {300 * 1000 * 1000}\r\n\r\n".encode() + b'{"text": "')
        reply = _read_to_eof(sock)
        sock.close()
        assert reply.startswith(b"HTTP/1.1 413") and b"this server accepts at most" in reply


def test_a_chunked_body_past_the_limit_is_a_413(scripted_server):
    url, _ = scripted_server(app_options={"limits": ServerLimits(max_body_bytes=1024)})
    sent = threading.Event()

    def chunks():  # a body without a length: the server must count as it reads
        for _ in range(100):
            yield b'{"text": "' + b"a" * 512
        sent.set()

    req = urllib.request.Request(url + "/generate", data=chunks(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=HANG_GUARD_S) as r:
            status = r.status
    except urllib.error.HTTPError as e:
        status, body = e.code, e.read()
        assert b"over 1024 bytes" in body
    except (ConnectionResetError, BrokenPipeError):  # the server closed before the client finished sending
        status = 413
    assert status == 413
