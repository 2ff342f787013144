"""Async OpenAI-compatible client for SGLang (or the reference server): streaming chat with timing.

Times are taken on arrival of each server-sent event: TTFT is the first chunk that carries output
(content, reasoning or a tool call), TPOT the remaining decode time over the remaining tokens.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import aiohttp

DEFAULT_REQUEST_TIMEOUT_S = 600.0
SSE_PREFIX = b"data: "
SSE_DONE = b"[DONE]"
MAX_ERROR_CHARS = 300


@dataclass
class ChatResult:
    ok: bool
    error: str = ""
    content: str = ""
    reasoning: str = ""
    tool_calls: list[dict] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    usage_reported: bool = False
    start: float = 0.0  # time.monotonic() when sent
    ttft_s: float | None = None
    latency_s: float = 0.0

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first (None with fewer than two tokens)."""
        if self.ttft_s is None or self.completion_tokens < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.completion_tokens - 1)


def _merge_tool_call_delta(calls: list[dict], delta: dict) -> None:
    idx = delta.get("index", len(calls))
    while len(calls) <= idx:
        calls.append({"id": None, "type": "function", "function": {"name": "", "arguments": ""}})
    call = calls[idx]
    if delta.get("id"):
        call["id"] = delta["id"]
    fn = delta.get("function") or {}
    if fn.get("name"):
        call["function"]["name"] += fn["name"]
    if fn.get("arguments"):
        call["function"]["arguments"] += fn["arguments"]


class ChatClient:
    """One aiohttp session against `base_url`; `async with ChatClient(url) as c: await c.chat(...)`."""

    def __init__(self, base_url: str, *, model: str | None = None, request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
                 max_connections: int = 256):
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.request_timeout_s = request_timeout_s
        self._max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> ChatClient:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=self._max_connections),
            timeout=aiohttp.ClientTimeout(total=self.request_timeout_s),
        )
        if self.model is None:
            self.model = (await self.get_json("/v1/models"))["data"][0]["id"]
        return self

    async def __aexit__(self, *exc) -> None:
        if self._session is not None:
            await self._session.close()

    async def get_json(self, path: str) -> dict:
        async with self._session.get(self.base_url + path) as r:
            r.raise_for_status()
            return await r.json()

    async def server_info(self) -> dict:
        """SGLang's /get_server_info (newer releases: /server_info)."""
        for path in ("/get_server_info", "/server_info"):
            try:
                return await self.get_json(path)
            except aiohttp.ClientResponseError:
                continue
        return {}

    async def context_length(self) -> int | None:
        """The served context: server info's `context_length` (None in SGLang unless set with
        --context-length), else /v1/models' `max_model_len` (SGLang's model card carries it)."""
        info = await self.server_info()
        if info.get("context_length"):
            return int(info["context_length"])
        models = await self.get_json("/v1/models")
        value = (models.get("data") or [{}])[0].get("max_model_len")
        return int(value) if value else None

    async def post_json(self, path: str, body: dict) -> dict:
        async with self._session.post(self.base_url + path, json=body) as r:
            if r.status != 200:
                raise aiohttp.ClientResponseError(r.request_info, r.history, status=r.status,
                                                  message=(await r.text())[:MAX_ERROR_CHARS])
            return await r.json()

    async def chat(self, messages: list[dict], *, max_tokens: int, temperature: float = 0.0,
                   tools: list[dict] | None = None, ignore_eos: bool = False, stream: bool = True,
                   extra: dict | None = None) -> ChatResult:
        body = {"model": self.model, "messages": messages, "max_tokens": max_tokens, "temperature": temperature,
                "stream": stream, **(extra or {})}
        if stream:
            body["stream_options"] = {"include_usage": True}
        if tools:
            body["tools"] = tools
        if ignore_eos:
            body["ignore_eos"] = True  # SGLang extension: fixed output length for load tests
        res = ChatResult(ok=False, start=time.monotonic())
        try:
            async with self._session.post(self.base_url + "/v1/chat/completions", json=body) as r:
                if r.status != 200:
                    res.error = f"HTTP {r.status}: {(await r.text())[:MAX_ERROR_CHARS]}"
                    return res
                if stream:
                    await self._read_stream(r, res)
                else:
                    self._read_whole(await r.json(), res)
        except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError) as e:
            res.error = f"{type(e).__name__}: {e}"[:MAX_ERROR_CHARS]
            return res
        res.latency_s = time.monotonic() - res.start
        res.ok = not res.error
        return res

    async def _read_stream(self, r: aiohttp.ClientResponse, res: ChatResult) -> None:
        async for raw in r.content:
            line = raw.strip()
            if not line.startswith(SSE_PREFIX):
                continue
            data = line[len(SSE_PREFIX):]
            if data == SSE_DONE:
                break
            chunk = json.loads(data)
            if "error" in chunk:
                res.error = str(chunk["error"])[:MAX_ERROR_CHARS]
                break
            for choice in chunk.get("choices") or []:
                delta = choice.get("delta") or {}
                got = False
                if delta.get("content"):
                    res.content += delta["content"]
                    got = True
                if delta.get("reasoning_content"):
                    res.reasoning += delta["reasoning_content"]
                    got = True
                for tc in delta.get("tool_calls") or []:
                    _merge_tool_call_delta(res.tool_calls, tc)
                    got = True
                if got and res.ttft_s is None:
                    res.ttft_s = time.monotonic() - res.start
                if choice.get("finish_reason"):
                    res.finish_reason = choice["finish_reason"]
            if chunk.get("usage"):
                self._read_usage(chunk["usage"], res)

    def _read_whole(self, body: dict, res: ChatResult) -> None:
        choice = body["choices"][0]
        msg = choice.get("message") or {}
        res.content = msg.get("content") or ""
        res.reasoning = msg.get("reasoning_content") or ""
        res.tool_calls = msg.get("tool_calls") or []
        res.finish_reason = choice.get("finish_reason")
        if body.get("usage"):
            self._read_usage(body["usage"], res)

    @staticmethod
    def _read_usage(usage: dict, res: ChatResult) -> None:
        res.usage_reported = True
        res.prompt_tokens = int(usage.get("prompt_tokens") or 0)
        res.completion_tokens = int(usage.get("completion_tokens") or 0)
        details = usage.get("prompt_tokens_details") or {}
        res.cached_tokens = int(details.get("cached_tokens") or 0)

    async def generate_ids(self, input_ids: list[int], *, max_new_tokens: int) -> dict:
        """SGLang native /generate, greedy, with per-token logprobs."""
        return await self.post_json("/generate", {
            "input_ids": input_ids, "return_logprob": True,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0},
        })

    async def generate(self, *, input_ids: list[int] | None = None, text: str | None = None, max_new_tokens: int,
                       ignore_eos: bool = False, temperature: float = 0.0) -> ChatResult:
        """SGLang native /generate of one prompt (token ids as served, or rendered text), timed like `chat`.

        Not streamed (the reference server's /generate answers whole), so `ttft_s` stays None; usage comes from
        `meta_info` (`prompt_tokens`, `completion_tokens`, `cached_tokens`)."""
        sampling = {"max_new_tokens": max_new_tokens, "temperature": temperature}
        if ignore_eos:
            sampling["ignore_eos"] = True
        body = {"input_ids": input_ids} if input_ids is not None else {"text": text}
        body["sampling_params"] = sampling
        res = ChatResult(ok=False, start=time.monotonic())
        try:
            async with self._session.post(self.base_url + "/generate", json=body) as r:
                if r.status != 200:
                    res.error = f"HTTP {r.status}: {(await r.text())[:MAX_ERROR_CHARS]}"
                    return res
                out = await r.json()
        except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError) as e:
            res.error = f"{type(e).__name__}: {e}"[:MAX_ERROR_CHARS]
            return res
        res.latency_s = time.monotonic() - res.start
        meta = out.get("meta_info") or {}
        finish = meta.get("finish_reason")
        res.finish_reason = finish.get("type") if isinstance(finish, dict) else finish
        res.content = out.get("text") or ""
        if "prompt_tokens" in meta:
            res.usage_reported = True
            res.prompt_tokens = int(meta.get("prompt_tokens") or 0)
            res.completion_tokens = int(meta.get("completion_tokens") or len(out.get("output_ids") or ()))
            res.cached_tokens = int(meta.get("cached_tokens") or 0)
        res.ok = True
        return res
