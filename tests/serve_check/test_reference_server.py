"""The reference server's HTTP layer (SGLang's subset), driven by the real async client."""

import asyncio
import json
import urllib.error
import urllib.request

import aiohttp

from kimi_nvfp4.serve_check.client import ChatClient

TOOL = {"type": "function", "function": {"name": "read_file", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}
CALL_TEXT = ("Reading.<|tool_calls_section_begin|><|tool_call_begin|>functions.read_file:0"
             "<|tool_call_argument_begin|>{\"path\": \"a.py\"}<|tool_call_end|><|tool_calls_section_end|>")
# SGLang reads a Kimi reply as reasoning unless the request turns thinking off (kimi_parsers.py)
THINKING_OFF = {"chat_template_kwargs": {"thinking": False}}


def _get(url):
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.status, r.read()


def _chat(url, **kw):
    async def main():
        async with ChatClient(url) as c:
            return await c.chat(**kw)
    return asyncio.run(main())


def test_info_endpoints(scripted_server):
    url, _ = scripted_server()
    assert _get(url + "/health_generate") == (200, b"OK")
    status, body = _get(url + "/v1/models")
    assert json.loads(body)["data"][0]["id"] == "scripted"
    for path in ("/get_server_info", "/server_info"):
        info = json.loads(_get(url + path)[1])
        assert info["reference_emulator"] is True and info["context_length"] == 1 << 16
        assert info["disable_radix_cache"] is False


def test_streaming_chat_reports_usage_and_cached_tokens(scripted_server):
    url, engine = scripted_server()
    msgs = [{"role": "user", "content": "hello " * 20}]
    first = _chat(url, messages=msgs, max_tokens=5, ignore_eos=True, extra=THINKING_OFF)
    assert first.ok and first.completion_tokens == 5 and len(first.content) == 5
    assert first.ttft_s is not None and first.tpot_s is not None
    assert first.prompt_tokens == len(engine.render_chat(msgs, None)) and first.cached_tokens == 0
    follow = msgs + [{"role": "assistant", "content": first.content}, {"role": "user", "content": "more"}]
    second = _chat(url, messages=follow, max_tokens=3)
    assert second.ok and second.usage_reported
    # the whole first prompt minus its trailing "[assistant]" marker overlaps
    assert second.cached_tokens >= first.prompt_tokens - len("[assistant]")
    assert second.cached_tokens < second.prompt_tokens


def test_tool_calls_streamed_and_whole(scripted_server):
    url, _ = scripted_server(script={"open a.py": "</think>" + CALL_TEXT})
    for stream in (True, False):
        res = _chat(url, messages=[{"role": "user", "content": "open a.py"}], max_tokens=200, tools=[TOOL],
                    stream=stream)
        assert res.ok, res.error
        assert res.content == "Reading." and res.reasoning == ""
        assert res.finish_reason == "tool_calls"
        (call,) = res.tool_calls
        assert call["id"] == "functions.read_file:0" and call["function"]["name"] == "read_file"
        assert json.loads(call["function"]["arguments"]) == {"path": "a.py"}


def test_calls_while_still_thinking_end_the_reasoning_and_ids_count_the_history(scripted_server):
    """No </think> before the section: SGLang ends the reasoning there and still returns the calls;
    ids are functions.NAME:K with K counted over the request's history (the model's :0 is ignored)."""
    url, _ = scripted_server(script={"open a.py": CALL_TEXT})
    history = [{"role": "user", "content": "start"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": "functions.read_file:0", "type": "function",
                    "function": {"name": "read_file", "arguments": "{\"path\": \"b.py\"}"}}]},
               {"role": "tool", "tool_call_id": "functions.read_file:0", "content": "b"},
               {"role": "user", "content": "open a.py"}]
    for stream in (True, False):
        res = _chat(url, messages=history, max_tokens=200, tools=[TOOL], stream=stream)
        assert res.ok, res.error
        assert res.reasoning == "Reading." and res.content == ""
        (call,) = res.tool_calls
        assert call["id"] == "functions.read_file:1" and res.finish_reason == "tool_calls"


def test_without_tools_the_section_is_not_parsed_into_calls(scripted_server):
    url, _ = scripted_server(script={"open a.py": CALL_TEXT})
    for stream in (True, False):
        res = _chat(url, messages=[{"role": "user", "content": "open a.py"}], max_tokens=200, stream=stream,
                    extra=THINKING_OFF)
        assert res.tool_calls == [] and res.finish_reason == "stop"
        assert res.content == CALL_TEXT


def test_reasoning_content_keeps_the_newline_after_think(scripted_server):
    url, _ = scripted_server(script={"think": "<think>let me see</think>\nDone."})
    for stream in (True, False):
        res = _chat(url, messages=[{"role": "user", "content": "think"}], max_tokens=100, stream=stream)
        assert res.reasoning == "let me see" and res.content == "\nDone."


def test_native_generate_returns_ids_and_logprobs(scripted_server):
    url, engine = scripted_server()

    async def main():
        async with ChatClient(url) as c:
            return await c.generate_ids(engine.encode("abc"), max_new_tokens=4)
    body = asyncio.run(main())
    assert len(body["output_ids"]) == 4
    assert [t for _, t, _ in body["meta_info"]["output_token_logprobs"]] == body["output_ids"]
    assert body["meta_info"]["prompt_tokens"] == 3


def test_bad_requests_are_400(scripted_server):
    url, _ = scripted_server(context_length=64)

    async def post(body):
        async with aiohttp.ClientSession() as s:
            async with s.post(url + "/v1/chat/completions", json=body) as r:
                return r.status, await r.json()
    status, body = asyncio.run(post({"messages": []}))
    assert status == 400 and "messages" in body["error"]["message"]
    status, body = asyncio.run(post({"messages": [{"role": "user", "content": "x" * 100}], "stream": False}))
    assert status == 400 and "context" in body["error"]["message"]
    res = _chat(url, messages=[{"role": "user", "content": "x" * 100}], max_tokens=2)
    assert not res.ok and "context" in res.error


def test_engine_failure_is_reported_not_hidden(scripted_server):
    url, engine = scripted_server()

    def broken(prompt_ids, params, should_stop=None):
        raise RuntimeError("input_scale missing for layer 1")
    engine.start = broken
    for stream in (True, False):
        res = _chat(url, messages=[{"role": "user", "content": "hi"}], max_tokens=2, stream=stream)
        assert not res.ok and "input_scale missing" in res.error
    try:
        _get(url + "/health_generate")
        raise AssertionError("expected 503")
    except urllib.error.HTTPError as e:
        assert e.code == 503
