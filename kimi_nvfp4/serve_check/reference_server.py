"""The reference server: SGLang's HTTP subset in front of a GenerationEngine (the NVFP4 emulator).

Endpoints (shapes follow sglang/srt/entrypoints/http_server.py and its OpenAI adapter):
  GET  /health, /health_generate (runs a one-token generation), /v1/models, /get_server_info, /server_info
  POST /v1/chat/completions  (stream or not; `stream_options.include_usage`; usage carries
                              `prompt_tokens_details.cached_tokens` as with --enable-cache-report;
                              tools -> kimi_k2 tool_calls; <think> -> reasoning_content; logprobs;
                              SGLang's `ignore_eos`)
  POST /generate             (SGLang native: input_ids or text, sampling_params, return_logprob)
Requests run one at a time on a single engine thread (the emulator is not batched); queued requests
wait, which is what their TTFT then shows.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from aiohttp import web

from .. import __version__
from ..errors import KimiNvfp4Error
from .engine import GenerationEngine, SamplingParams
from .kimi_parsers import THINK_BEGIN, StreamSplitter, parse_tool_calls, split_reasoning

DEFAULT_MAX_TOKENS = 256
HEALTH_MAX_TOKENS = 1
READY_TIMEOUT_S = 60.0
REPLACEMENT_CHAR = "\ufffd"  # a partial UTF-8 sequence: wait for the next token before emitting


class BadRequest(Exception):
    pass


@dataclass
class _Generated:
    """What the engine thread produced for one request."""

    prompt_tokens: int
    cached_tokens: int = 0
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    token_texts: list[str] = field(default_factory=list)
    text: str = ""
    finish_reason: str = "length"


_DONE = object()


class ReferenceApp:
    """aiohttp handlers bound to one engine."""

    def __init__(self, engine: GenerationEngine):
        self.engine = engine
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        self.requests_served = 0

    def build(self) -> web.Application:
        app = web.Application(client_max_size=256 * 1024 * 1024)  # 100k-token prompts are megabytes
        app.router.add_get("/health", self.health)
        app.router.add_get("/health_generate", self.health_generate)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/get_server_info", self.server_info)
        app.router.add_get("/server_info", self.server_info)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/generate", self.generate)
        app.on_cleanup.append(self._shutdown)
        return app

    async def _shutdown(self, app) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    # --- engine thread ------------------------------------------------------------------------
    def _generate_blocking(self, prompt_ids, params, emit, cancelled: threading.Event) -> _Generated:
        if len(prompt_ids) + 1 > self.engine.context_length:
            raise BadRequest(
                f"prompt has {len(prompt_ids)} tokens; the model's context is {self.engine.context_length}"
            )
        params = SamplingParams(
            max_new_tokens=min(params.max_new_tokens, self.engine.context_length - len(prompt_ids)),
            temperature=params.temperature, top_p=params.top_p, seed=params.seed, ignore_eos=params.ignore_eos,
        )
        stream = self.engine.start(list(prompt_ids), params)
        out = _Generated(prompt_tokens=len(prompt_ids), cached_tokens=stream.cached_tokens)
        emitted = ""
        text_ids: list[int] = []  # output minus a final stop token (SGLang leaves it out of the text)
        for ev in stream:
            out.output_ids.append(ev.token_id)
            out.logprobs.append(ev.logprob)
            out.token_texts.append(self.engine.decode([ev.token_id]))
            if ev.is_stop:
                break
            text_ids.append(ev.token_id)
            text = self.engine.decode(text_ids)
            if not text.endswith(REPLACEMENT_CHAR) and emit is not None:
                emit(text[len(emitted):])
                emitted = text
            if cancelled.is_set():
                break
        out.finish_reason = stream.finish_reason
        out.text = self.engine.decode(text_ids)
        if emit is not None and len(out.text) > len(emitted):
            emit(out.text[len(emitted):])
        self.requests_served += 1
        return out

    async def _run(self, prompt_ids, params, on_delta=None) -> _Generated:
        loop = asyncio.get_running_loop()
        cancelled = threading.Event()
        queue: asyncio.Queue = asyncio.Queue()
        emit = (lambda d: loop.call_soon_threadsafe(queue.put_nowait, d)) if on_delta else None
        fut = loop.run_in_executor(self._executor, self._generate_blocking, prompt_ids, params, emit, cancelled)
        if on_delta is None:
            return await fut
        fut.add_done_callback(lambda _: loop.call_soon_threadsafe(queue.put_nowait, _DONE))
        try:
            while (item := await queue.get()) is not _DONE:
                if item:
                    await on_delta(item)
        except (ConnectionResetError, asyncio.CancelledError):
            cancelled.set()
            raise
        return await fut

    # --- handlers -----------------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="OK")

    async def health_generate(self, request: web.Request) -> web.Response:
        try:
            ids = self.engine.render_chat([{"role": "user", "content": "ping"}], None)
            await self._run(ids, SamplingParams(max_new_tokens=HEALTH_MAX_TOKENS))
        except Exception as e:  # a broken engine must read as unhealthy, not crash the server
            return web.Response(status=503, text=f"generation failed: {e}")
        return web.Response(text="OK")

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{
            "id": self.engine.model_name, "object": "model", "created": 0, "owned_by": "kimi-nvfp4",
            "root": self.engine.model_path, "max_model_len": self.engine.context_length}]})

    async def server_info(self, request: web.Request) -> web.Response:
        cache = self.engine.prefix_cache
        return web.json_response({
            "model_path": self.engine.model_path,
            "served_model_name": self.engine.model_name,
            "context_length": self.engine.context_length,
            "max_total_num_tokens": cache.max_tokens if cache else 0,
            "disable_radix_cache": cache is None,
            "tp_size": 1,
            "quantization": "modelopt_fp4",
            "kv_cache_dtype": "auto",
            "version": f"kimi-nvfp4 {__version__} reference emulator",
            "reference_emulator": True,
            "emulated_activations": getattr(self.engine, "activations", None),
            "prefix_cache": {"cached_tokens": cache.cached_tokens, "snapshots": len(cache),
                             "hit_rate": cache.stats.hit_rate} if cache else None,
        })

    async def generate(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
            if "input_ids" in body:
                ids = [int(t) for t in body["input_ids"]]
            elif "text" in body:
                ids = self.engine.encode(str(body["text"]))
            else:
                raise BadRequest("expected 'input_ids' or 'text'")
            params = _sampling_from_native(body.get("sampling_params") or {})
        except (BadRequest, ValueError, TypeError, json.JSONDecodeError) as e:
            return _error(400, str(e))
        try:
            out = await self._run(ids, params)
        except BadRequest as e:
            return _error(400, str(e))
        except Exception as e:  # the engine failed: say why instead of a bare 500
            return _error(500, f"generation failed: {type(e).__name__}: {e}")
        meta = {
            "id": uuid.uuid4().hex, "prompt_tokens": out.prompt_tokens, "completion_tokens": len(out.output_ids),
            "cached_tokens": out.cached_tokens,
            "finish_reason": {"type": out.finish_reason, **({"matched": out.output_ids[-1]}
                                                            if out.finish_reason == "stop" else
                                                            {"length": len(out.output_ids)})},
        }
        if body.get("return_logprob"):
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(out.logprobs, out.output_ids)]
        return web.json_response({"text": out.text, "output_ids": out.output_ids, "meta_info": meta})

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise BadRequest("'messages' must be a non-empty list")
            tools = body.get("tools") or None
            if body.get("tool_choice") == "none":
                tools = None
            template_kwargs = body.get("chat_template_kwargs") or {}
            if not isinstance(template_kwargs, dict):
                raise BadRequest("'chat_template_kwargs' must be an object")
            prompt_ids = self.engine.render_chat(messages, tools, **template_kwargs)
            params = _sampling_from_openai(body)
        except (BadRequest, ValueError, TypeError, KeyError, json.JSONDecodeError) as e:
            return _error(400, str(e))
        in_reasoning = self.engine.decode(prompt_ids[-4:]).rstrip().endswith(THINK_BEGIN)
        rid = "chatcmpl-" + uuid.uuid4().hex
        created = int(time.time())
        want_logprobs = bool(body.get("logprobs"))
        if not body.get("stream"):
            try:
                out = await self._run(prompt_ids, params)
            except BadRequest as e:
                return _error(400, str(e))
            except Exception as e:
                return _error(500, f"generation failed: {type(e).__name__}: {e}")
            reasoning, content = split_reasoning(out.text, in_reasoning=in_reasoning)
            calls = []
            if tools:
                content, calls = parse_tool_calls(content)
            message: dict = {"role": "assistant", "content": content if content or not calls else None}
            if reasoning:
                message["reasoning_content"] = reasoning
            if calls:
                message["tool_calls"] = [c.to_openai(i) for i, c in enumerate(calls)]
            finish = "tool_calls" if calls else out.finish_reason
            return web.json_response({
                "id": rid, "object": "chat.completion", "created": created, "model": self.engine.model_name,
                "choices": [{"index": 0, "message": message, "finish_reason": finish,
                             "logprobs": _openai_logprobs(out) if want_logprobs else None}],
                "usage": _usage(out),
            })
        return await self._stream_chat(request, body, prompt_ids, params, tools, in_reasoning, rid, created)

    async def _stream_chat(self, request, body, prompt_ids, params, tools, in_reasoning, rid, created):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        model = self.engine.model_name

        async def send(delta: dict | None, finish: str | None = None, usage: dict | None = None) -> None:
            chunk = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                     "choices": [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish,
                                                           "logprobs": None}]}
            if usage is not None:
                chunk["usage"] = usage
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())

        splitter = StreamSplitter(in_reasoning=in_reasoning, parse_tools=bool(tools))
        await send({"role": "assistant", "content": ""})

        async def on_delta(text: str) -> None:
            reasoning, content = splitter.feed(text)
            if reasoning:
                await send({"reasoning_content": reasoning})
            if content:
                await send({"content": content})

        try:
            out = await self._run(prompt_ids, params, on_delta)
        except Exception as e:  # headers are sent: report in-stream, as SGLang does
            code, message = (400, str(e)) if isinstance(e, BadRequest) else (500, f"generation failed: {e}")
            await resp.write(f"data: {json.dumps({'error': {'message': message, 'code': code}})}\n\n".encode())
            await resp.write(b"data: [DONE]\n\n")
            return resp
        reasoning, content, calls = splitter.finish()
        if reasoning:
            await send({"reasoning_content": reasoning})
        if content:
            await send({"content": content})
        finish = out.finish_reason
        if calls:
            await send({"tool_calls": [c.to_openai(i) for i, c in enumerate(calls)]})
            finish = "tool_calls"
        await send({}, finish)
        if (body.get("stream_options") or {}).get("include_usage"):
            await send(None, usage=_usage(out))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


def _usage(out: _Generated) -> dict:
    return {"prompt_tokens": out.prompt_tokens, "completion_tokens": len(out.output_ids),
            "total_tokens": out.prompt_tokens + len(out.output_ids),
            "prompt_tokens_details": {"cached_tokens": out.cached_tokens}}


def _openai_logprobs(out: _Generated) -> dict:
    return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                        for t, lp in zip(out.token_texts, out.logprobs)]}


def _positive_int(value, name: str) -> int:
    v = int(value)
    if v < 1:
        raise BadRequest(f"'{name}' must be >= 1, got {value}")
    return v


def _sampling_from_openai(body: dict) -> SamplingParams:
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens")) or DEFAULT_MAX_TOKENS
    return SamplingParams(
        max_new_tokens=_positive_int(max_tokens, "max_tokens"),
        temperature=float(body.get("temperature", 0.0) or 0.0),
        top_p=float(body.get("top_p", 1.0) or 1.0),
        seed=body.get("seed"),
        ignore_eos=bool(body.get("ignore_eos", False)),
    )


def _sampling_from_native(sp: dict) -> SamplingParams:
    return SamplingParams(
        max_new_tokens=_positive_int(sp.get("max_new_tokens", DEFAULT_MAX_TOKENS), "max_new_tokens"),
        temperature=float(sp.get("temperature", 1.0)),  # SGLang's native default is 1.0
        top_p=float(sp.get("top_p", 1.0)),
        seed=sp.get("sampling_seed"),
        ignore_eos=bool(sp.get("ignore_eos", False)),
    )


def _error(status: int, message: str) -> web.Response:
    kind = "invalid_request_error" if status < 500 else "internal_error"
    return web.json_response({"error": {"message": message, "type": kind, "code": status}}, status=status)


class ReferenceServer:
    """Runs ReferenceApp on its own event loop in a background thread: `start()` returns the base URL."""

    def __init__(self, engine: GenerationEngine, host: str = "127.0.0.1", port: int = 0):
        self.engine = engine
        self.host = host
        self.port = port
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def _serve(self) -> None:
        self._runner = web.AppRunner(ReferenceApp(self.engine).build(), access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = self._runner.addresses[0][1]  # port 0 -> the one the OS picked

    def _main(self) -> None:
        self._loop = asyncio.new_event_loop()
        try:
            self._loop.run_until_complete(self._serve())
        except BaseException as e:
            self._error = e
            self._ready.set()
            return
        self._ready.set()
        self._loop.run_forever()
        self._loop.run_until_complete(self._runner.cleanup())
        self._loop.close()

    def start(self) -> str:
        self._thread = threading.Thread(target=self._main, name="reference-server", daemon=True)
        self._thread.start()
        if not self._ready.wait(READY_TIMEOUT_S):
            raise KimiNvfp4Error(f"reference server did not start within {READY_TIMEOUT_S:.0f} s")
        if self._error is not None:
            raise KimiNvfp4Error(f"reference server could not listen on {self.host}:{self.port}: {self._error}")
        return self.base_url

    def stop(self) -> None:
        if self._loop is not None and self._thread is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=30)

    def __enter__(self) -> ReferenceServer:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def serve_forever(engine: GenerationEngine, host: str, port: int) -> None:
    """Blocking server for `kimi-nvfp4 serve-reference`; Ctrl-C stops it."""
    web.run_app(ReferenceApp(engine).build(), host=host, port=port, access_log=None, print=None)
