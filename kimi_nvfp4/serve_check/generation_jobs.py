"""One generation of the reference server: run on the engine thread, followed from the event loop.

`GenerationRunner.submit` admits a request into the bounded `EngineWorker` queue (ServerBusy when
full); `wait` follows it from an aiohttp handler, passing text deltas on for streaming, and
cancels it when the client's connection closes (the engine stops at its next token, or never
starts a request that was still waiting). `stop` tells every request to stop at its next token.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from aiohttp import web

from .engine import GenerationEngine, SamplingParams
from .engine_worker import EngineWorker

REPLACEMENT_CHAR = "\ufffd"  # a partial UTF-8 sequence: wait for the next token before emitting
# How often a waiting request looks whether its client is still connected.
DISCONNECT_POLL_S = 0.2


@dataclass
class Generated:
    """What the engine thread produced for one request."""

    prompt_tokens: int
    cached_tokens: int = 0
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    token_texts: list[str] = field(default_factory=list)
    text: str = ""
    finish_reason: str = "length"


class ClientGone(Exception):
    """The client closed its connection while its request was queued or running."""


@dataclass
class Job:
    """One admitted generation as the event loop follows it."""

    wake: asyncio.Event
    deltas: list[str] = field(default_factory=list)
    cfut: Future | None = None
    fut: asyncio.Future | None = None
    cancelled: threading.Event | None = None

    def cancel(self) -> None:
        self.cancelled.set()
        self.cfut.cancel()  # still waiting: never starts


def client_gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


class GenerationRunner:
    """Runs generations of `engine` one at a time on an EngineWorker of at most `max_pending` requests."""

    def __init__(self, engine: GenerationEngine, max_pending: int):
        self.engine = engine
        self.worker = EngineWorker("engine", max_pending)
        self.requests_served = 0

    def stop(self) -> None:
        self.worker.stop()

    def _generate_blocking(self, prompt_ids: list[int], params: SamplingParams, emit: Callable[[str], None] | None,
                           cancelled: threading.Event) -> Generated:
        """On the engine thread: generate, emitting text deltas; stop at the next token once cancelled."""
        stream = self.engine.start(list(prompt_ids), params, should_stop=cancelled.is_set)
        out = Generated(prompt_tokens=len(prompt_ids), cached_tokens=stream.cached_tokens)
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
                stream.finish_reason = "abort"  # SGLang's finish reason for an aborted request
                break
        if cancelled.is_set():
            stream.finish_reason = "abort"
        out.finish_reason = stream.finish_reason
        out.text = self.engine.decode(text_ids)
        if emit is not None and len(out.text) > len(emitted):
            emit(out.text[len(emitted):])
        self.requests_served += 1
        return out

    def submit(self, prompt_ids: list[int], params: SamplingParams, streaming: bool = False) -> Job:
        """Admit one generation (ServerBusy when the queue is full); `wait` then follows it."""
        loop = asyncio.get_running_loop()
        job = Job(wake=asyncio.Event())

        def push(delta: str) -> None:
            job.deltas.append(delta)
            job.wake.set()

        emit = (lambda d: loop.call_soon_threadsafe(push, d)) if streaming else None
        job.cfut, job.cancelled = self.worker.submit(self._generate_blocking, prompt_ids, params, emit)
        job.fut = asyncio.wrap_future(job.cfut)
        job.fut.add_done_callback(lambda _: job.wake.set())
        return job

    async def wait(self, request: web.Request, job: Job,
                   on_delta: Callable[[str], Awaitable[None]] | None = None) -> Generated:
        """The job's result, passing text deltas on; stops the job when the client leaves."""
        try:
            while True:
                try:
                    await asyncio.wait_for(job.wake.wait(), DISCONNECT_POLL_S)
                except TimeoutError:
                    pass
                job.wake.clear()
                while job.deltas and on_delta is not None:
                    await on_delta(job.deltas.pop(0))
                if job.fut.done():
                    return job.fut.result()
                if client_gone(request):
                    raise ClientGone()
        except (ClientGone, ConnectionResetError, asyncio.CancelledError):
            job.cancel()
            raise

    async def run(self, request: web.Request, prompt_ids: list[int], params: SamplingParams) -> Generated:
        return await self.wait(request, self.submit(prompt_ids, params))
