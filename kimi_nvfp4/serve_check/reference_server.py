"""The reference server: SGLang's HTTP subset in front of a GenerationEngine (the NVFP4 emulator).

Endpoints (shapes follow sglang/srt/entrypoints/http_server.py and its OpenAI adapter):
  GET  /health, /health_generate (runs a one-token generation), /v1/models, /get_server_info, /server_info
  POST /v1/chat/completions  (stream or not; `stream_options.include_usage`; usage carries
                              `prompt_tokens_details.cached_tokens` as with --enable-cache-report;
                              tools -> kimi_k2 tool_calls; <think> -> reasoning_content; logprobs;
                              SGLang's `ignore_eos`)
  POST /generate             (SGLang native: input_ids or text, sampling_params, return_logprob)

One request cannot monopolise it: requests are validated before they queue (server_requests: a
prompt or a token budget beyond the context is a 400), at most `max_pending` are held (one more is
a 503), up to `max_running` of them are interleaved token by token (step_scheduler), each within a
token cap (`max_new_tokens_limit`, DEFAULT_MAX_NEW_TOKENS_LIMIT unless told otherwise) and a wall
time budget (`time_budget_s`), a request whose client went away stops at its next token (or never
starts), bodies, slow readers and stalled sockets are bounded (http_limits), rendering runs off the
event loop in its own thread (a template bomb is a 400 within the template budget), and stopping
the server (SIGTERM/SIGINT, `ReferenceServer.stop`) stops every request at its next token.
"""

from __future__ import annotations

import asyncio
import errno
import json
import threading
import time
import uuid
from collections.abc import Awaitable, Callable

from aiohttp import web

from .. import __version__
from ..errors import KimiNvfp4Error
from .engine import GenerationEngine, SamplingParams
from .engine_worker import DEFAULT_MAX_PENDING, EngineWorker, RequestCancelled
from .generation_jobs import DEFAULT_TIME_BUDGET_S, ClientGone, Generated, GenerationRunner
from .http_limits import (BodyTimeout, PayloadTooLarge, ServerLimits, close_after, limit_stream_buffers,
                          read_json_body, write_or_close)
from .kimi_parsers import StreamSplitter, history_tool_calls, parse_tool_calls, reasoning_forced, split_reasoning
from .launcher import ServerLaunchError
from .step_scheduler import DEFAULT_MAX_RUNNING
from .server_requests import (DEFAULT_MAX_NEW_TOKENS_LIMIT, BadRequest, ServerBusy, parse_chat_request, parse_generate_request,
                              resolve_max_new_tokens, sampling_params)

HEALTH_MAX_TOKENS = 1
READY_TIMEOUT_S = 60.0
# After SIGTERM/SIGINT: how long open connections get to finish (their requests stop at the next token).
SHUTDOWN_GRACE_S = 5.0


class ReferenceApp:
    """aiohttp handlers bound to one engine.

    :param max_pending: requests held at once (running + waiting); one more gets a 503.
    :param max_running: requests interleaved token by token (SGLang's --max-running-requests).
    :param max_new_tokens_limit: cap on the tokens one request may generate (SGLang's
        SGLANG_MAX_NEW_TOKENS_LIMIT); None: the model's context is the only limit.
    :param time_budget_s: wall seconds one generation may run; past it, it ends as "length".
    :param limits: body size and read time, write timeout of streams, header timeout.
    """

    def __init__(self, engine: GenerationEngine, *, max_pending: int = DEFAULT_MAX_PENDING,
                 max_running: int = DEFAULT_MAX_RUNNING,
                 max_new_tokens_limit: int | None = DEFAULT_MAX_NEW_TOKENS_LIMIT,
                 time_budget_s: float | None = DEFAULT_TIME_BUDGET_S, limits: ServerLimits | None = None):
        self.engine = engine
        self.max_new_tokens_limit = max_new_tokens_limit
        self.limits = limits or ServerLimits()
        self.runner = GenerationRunner(engine, max_pending, max_running=max_running, time_budget_s=time_budget_s)
        # templates render in their own thread: the event loop stays free while one runs to its budget
        self.renderer = EngineWorker("render", max_pending)

    def build(self) -> web.Application:
        # read_json_body enforces the body limit itself (413 before reading); this is aiohttp's backstop
        app = web.Application(client_max_size=self.limits.max_body_bytes)
        app.router.add_get("/health", self.health)
        app.router.add_get("/health_generate", self.health_generate)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/get_server_info", self.server_info)
        app.router.add_get("/server_info", self.server_info)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/generate", self.generate)
        app.on_shutdown.append(self._shutdown)
        return app

    async def _shutdown(self, app: web.Application) -> None:
        self.stop()

    def stop(self) -> None:
        """Stop every request at its next token and refuse new ones."""
        self.runner.stop()
        self.renderer.stop()

    async def _render(self, messages: list[dict], tools: list[dict] | None, template_kwargs: dict) -> list[int]:
        fut, _ = self.renderer.submit(lambda cancelled: self.engine.render_chat(messages, tools, **template_kwargs))
        try:
            return await asyncio.wrap_future(fut)
        except KimiNvfp4Error as e:  # the template refused these messages (or went past its budget)
            raise BadRequest(str(e)) from None

    async def _handle(self, handler: Callable[[], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        """Typed failures become their status; an engine failure is a named 500, never a bare one."""
        try:
            return await handler()
        except (BadRequest, ServerBusy) as e:
            return _error(e.status, str(e))
        except (PayloadTooLarge, BodyTimeout) as e:  # the rest of the body is never read: close after
            return close_after(_error(e.status, str(e)))
        except RequestCancelled as e:
            return _error(503, f"request cancelled: {e}")
        except ClientGone:
            return web.Response(status=499)  # nobody reads it; nginx's code for a closed client
        except Exception as e:
            return _error(500, f"generation failed: {type(e).__name__}: {e}")

    # --- handlers -----------------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="OK")

    async def health_generate(self, request: web.Request) -> web.Response:
        try:
            ids = await self._render([{"role": "user", "content": "ping"}], None, {})
            await self.runner.run(request, ids, SamplingParams(max_new_tokens=HEALTH_MAX_TOKENS))
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
            "vocab_size": self.engine.vocab_size,
            "max_total_num_tokens": cache.max_tokens if cache is not None else 0,
            "disable_radix_cache": cache is None,
            "tp_size": 1,
            "quantization": "modelopt_fp4",
            "kv_cache_dtype": "auto",
            "version": f"kimi-nvfp4 {__version__} reference emulator",
            "reference_emulator": True,
            "emulated_activations": getattr(self.engine, "activations", None),
            "max_queued_requests": self.runner.max_pending,
            "max_running_requests": self.runner.scheduler.max_running,
            "max_new_tokens_limit": self.max_new_tokens_limit,
            "generation_time_budget_s": self.runner.time_budget_s,
            # an empty cache is still a cache: report it, zeros included
            "prefix_cache": {"cached_tokens": cache.cached_tokens, "snapshots": len(cache),
                             "hit_rate": cache.stats.hit_rate} if cache is not None else None,
        })

    def _budget(self, requested: int | None, prompt_ids: list[int]) -> int:
        return resolve_max_new_tokens(requested, len(prompt_ids), self.engine.context_length, self.max_new_tokens_limit)

    async def generate(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(lambda: self._generate(request))

    async def _generate(self, request: web.Request) -> web.Response:
        body = parse_generate_request(await read_json_body(request, self.limits), self.engine.vocab_size)
        ids = body.input_ids if body.input_ids is not None else self.engine.encode(body.text or "")
        params = sampling_params(self._budget(body.max_new_tokens, ids), body.sampling)
        out = await self.runner.run(request, ids, params)
        meta = {
            "id": uuid.uuid4().hex, "prompt_tokens": out.prompt_tokens, "completion_tokens": len(out.output_ids),
            "cached_tokens": out.cached_tokens,
            "finish_reason": {"type": out.finish_reason, **({"matched": out.output_ids[-1]}
                                                            if out.finish_reason == "stop" else
                                                            {"length": len(out.output_ids)})},
        }
        if body.return_logprob:
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(out.logprobs, out.output_ids)]
        return web.json_response({"text": out.text, "output_ids": out.output_ids, "meta_info": meta})

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(lambda: self._chat(request))

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        req = parse_chat_request(await read_json_body(request, self.limits), getattr(self.engine, "generation_defaults", None))
        prompt_ids = await self._render(req.messages, req.tools, req.template_kwargs)
        params = sampling_params(self._budget(req.max_new_tokens, prompt_ids), req.sampling)
        rid = "chatcmpl-" + uuid.uuid4().hex
        created = int(time.time())
        if req.stream:
            return await self._stream_chat(request, req, prompt_ids, params, rid, created)
        out = await self.runner.run(request, prompt_ids, params)
        kwargs = req.template_kwargs
        reasoning, content = split_reasoning(out.text, force_reasoning=reasoning_forced(kwargs),
                                             force_nonempty_content=kwargs.get("force_nonempty_content") is True)
        calls = []
        if req.tools:
            content, calls = parse_tool_calls(content, req.tools)
        history = history_tool_calls(req.messages)
        # SGLang answers content "" rather than null, and reasoning_content only when there is some
        message: dict = {"role": "assistant", "content": content}
        if reasoning:
            message["reasoning_content"] = reasoning
        if calls:
            message["tool_calls"] = [c.to_openai(i, history) for i, c in enumerate(calls)]
        finish = "tool_calls" if calls and out.finish_reason == "stop" else out.finish_reason
        return web.json_response({
            "id": rid, "object": "chat.completion", "created": created, "model": self.engine.model_name,
            "choices": [{"index": 0, "message": message, "finish_reason": finish,
                         "logprobs": _openai_logprobs(out) if req.logprobs else None}],
            "usage": _usage(out),
        })

    async def _stream_chat(self, request, req, prompt_ids, params, rid, created):
        job = self.runner.submit(prompt_ids, params, streaming=True)  # a full queue is a 503, before any header
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        try:
            await resp.prepare(request)
        except (ConnectionResetError, asyncio.CancelledError):
            job.cancel()
            raise
        limit_stream_buffers(request, self.limits)
        model = self.engine.model_name

        async def send(delta: dict | None, finish: str | None = None, usage: dict | None = None) -> None:
            chunk = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                     "choices": [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish,
                                                           "logprobs": None}]}
            if usage is not None:
                chunk["usage"] = usage
            await write_or_close(request, resp, f"data: {json.dumps(chunk)}\n\n".encode(), self.limits)

        kwargs = req.template_kwargs
        splitter = StreamSplitter(force_reasoning=reasoning_forced(kwargs), parse_tools=bool(req.tools),
                                  tools=req.tools, force_nonempty_content=kwargs.get("force_nonempty_content") is True)
        try:
            await send({"role": "assistant", "content": ""})
        except ClientGone:
            job.cancel()
            return resp

        async def on_delta(text: str) -> None:
            reasoning, content = splitter.feed(text)
            if reasoning:
                await send({"reasoning_content": reasoning})
            if content:
                await send({"content": content})

        try:
            out = await self.runner.wait(request, job, on_delta)
        except (ClientGone, ConnectionResetError):
            return resp
        except Exception as e:  # headers are sent: report in-stream, as SGLang does
            code, message = (e.status, str(e)) if isinstance(e, (BadRequest, ServerBusy)) else \
                (500, f"generation failed: {type(e).__name__}: {e}")
            try:
                await write_or_close(request, resp, f"data: {json.dumps({'error': {'message': message, 'code': code}})}"
                                     "\n\ndata: [DONE]\n\n".encode(), self.limits)
            except (ClientGone, ConnectionResetError):
                pass
            return resp
        try:
            await self._finish_stream(request, resp, req, out, splitter, send)
        except (ClientGone, ConnectionResetError):
            pass  # the generation is over; a client that stopped reading only loses its tail
        return resp

    async def _finish_stream(self, request, resp, req, out, splitter, send) -> None:
        reasoning, content, calls = splitter.finish()
        if reasoning:
            await send({"reasoning_content": reasoning})
        if content:
            await send({"content": content})
        finish = out.finish_reason
        if calls:
            history = history_tool_calls(req.messages)
            await send({"tool_calls": [c.to_openai(i, history) for i, c in enumerate(calls)]})
            if finish == "stop":
                finish = "tool_calls"
        await send({}, finish)
        if req.include_usage:
            await send(None, usage=_usage(out))
        await write_or_close(request, resp, b"data: [DONE]\n\n", self.limits)
        await resp.write_eof()


def _usage(out: Generated) -> dict:
    return {"prompt_tokens": out.prompt_tokens, "completion_tokens": len(out.output_ids),
            "total_tokens": out.prompt_tokens + len(out.output_ids),
            "prompt_tokens_details": {"cached_tokens": out.cached_tokens}}


def _openai_logprobs(out: Generated) -> dict:
    return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                        for t, lp in zip(out.token_texts, out.logprobs)]}


def _error(status: int, message: str) -> web.Response:
    kind = "invalid_request_error" if status < 500 else "internal_error"
    return web.json_response({"error": {"message": message, "type": kind, "code": status}}, status=status)


class ReferenceServer:
    """Runs ReferenceApp on its own event loop in a background thread: `start()` returns the base URL.

    `app_options` go to ReferenceApp (max_pending, max_running, max_new_tokens_limit, time_budget_s, limits).
    """

    def __init__(self, engine: GenerationEngine, host: str = "127.0.0.1", port: int = 0, **app_options):
        self.engine = engine
        self.host = host
        self.port = port
        self.app = ReferenceApp(engine, **app_options)
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def _serve(self) -> None:
        self._runner = web.AppRunner(self.app.build(), access_log=None, shutdown_timeout=SHUTDOWN_GRACE_S,
                                     **self.app.limits.runner_options())
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
            raise listen_error(self.host, self.port, self._error)
        return self.base_url

    def stop(self) -> None:
        """Stop running requests at their next token, then the server."""
        self.app.stop()
        if self._loop is not None and self._thread is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=30)

    def __enter__(self) -> ReferenceServer:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def listen_error(host: str, port: int, error: BaseException) -> ServerLaunchError:
    if isinstance(error, OSError) and error.errno == errno.EADDRINUSE:
        return ServerLaunchError(f"port {port} on {host} is already in use (another server is listening there); "
                                 "stop it or choose another --port")
    reason = error.strerror if isinstance(error, OSError) and error.strerror else error
    return ServerLaunchError(f"cannot listen on {host}:{port}: {reason}")


def serve_forever(engine: GenerationEngine, host: str, port: int, **app_options) -> None:
    """Blocking server for `kimi-nvfp4 serve-reference`.

    SIGTERM and SIGINT stop it cleanly, also while a request runs: every request stops at its next
    token, open connections get SHUTDOWN_GRACE_S to finish, and the engine thread (a daemon) does
    not hold the process. A busy port is a ServerLaunchError naming it.
    """
    app = ReferenceApp(engine, **app_options)
    try:
        web.run_app(app.build(), host=host, port=port, access_log=None, print=None,
                    shutdown_timeout=SHUTDOWN_GRACE_S, handle_signals=True, **app.limits.runner_options())
    except OSError as e:
        raise listen_error(host, port, e) from None
    finally:
        app.stop()
