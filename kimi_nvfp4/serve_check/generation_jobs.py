"""One generation of the reference server: stepped on the engine thread, followed from the event loop.

`GenerationRunner.submit` admits a request into the bounded `StepScheduler` (ServerBusy when
full), which interleaves the admitted generations token by token; `wait` follows one from an
aiohttp handler, passing text deltas on for streaming, and cancels it when the client's connection
closes (the engine stops at its next token, or never starts a request that was still waiting).
`stop` tells every request to stop at its next token.

Every generation is bounded twice: by its token budget (resolved by server_requests, capped by the
server's max_new_tokens_limit) and by `time_budget_s` of wall time from its first step; past it,
it ends like a token-budget cut, `finish_reason: "length"`. A streaming generation whose client has
not taken `MAX_STREAM_BACKLOG` deltas pauses (it holds no engine time and no growing buffer) until
the client reads or the handler's write timeout closes the connection.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from aiohttp import web

from .engine import GenerationEngine, SamplingParams
from .step_scheduler import DEFAULT_MAX_RUNNING, Step, StepScheduler

REPLACEMENT_CHAR = "\ufffd"  # a partial UTF-8 sequence: wait for the next token before emitting
# How often a waiting request looks whether its client is still connected.
DISCONNECT_POLL_S = 0.2
# Wall seconds one generation may run (from its first step, prefill included), unless told otherwise.
DEFAULT_TIME_BUDGET_S = 600.0
# Deltas a streaming generation may be ahead of its client before it pauses.
MAX_STREAM_BACKLOG = 256


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


class GenerationTask:
    """One generation as the engine thread steps it: each `step` produces at most one token."""

    def __init__(self, engine: GenerationEngine, prompt_ids: list[int], params: SamplingParams,
                 emit: Callable[[str], None] | None, time_budget_s: float | None):
        self.engine = engine
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.emit = emit
        self.time_budget_s = time_budget_s
        self.cancelled = threading.Event()
        # deltas emitted (engine thread) and taken by the handler (event loop): each side writes its own
        self.emitted = 0
        self.consumed = 0
        self.out = Generated(prompt_tokens=len(self.prompt_ids))
        self._deadline: float | None = None
        self._stream = None
        self._tokens = None
        self._text_ids: list[int] = []  # output minus a final stop token (SGLang leaves it out of the text)
        self._sent = ""

    def _out_of_time(self) -> bool:
        return self._deadline is not None and time.monotonic() >= self._deadline

    def _should_stop(self) -> bool:  # asked by the engine between prefill chunks
        return self.cancelled.is_set() or self._out_of_time()

    def _emit(self, delta: str) -> None:
        if self.emit is not None and delta:
            self.emitted += 1
            self.emit(delta)

    def step(self) -> Step:
        if self.cancelled.is_set():
            return self._finish("abort")  # SGLang's finish reason for an aborted request
        if self._stream is None:
            if self.time_budget_s is not None:
                self._deadline = time.monotonic() + self.time_budget_s
            self._stream = self.engine.start(self.prompt_ids, self.params, should_stop=self._should_stop)
            self._tokens = iter(self._stream)
            self.out.cached_tokens = self._stream.cached_tokens
        elif self._out_of_time():
            return self._finish("length")  # cut by a server limit, as max_new_tokens_limit cuts
        elif self.emit is not None and self.emitted - self.consumed > MAX_STREAM_BACKLOG:
            return Step.PAUSED
        try:
            ev = next(self._tokens)
        except StopIteration:
            reason = self._stream.finish_reason
            if reason == "abort" and not self.cancelled.is_set():
                reason = "length"  # the engine stopped in prefill because the time budget ran out
            return self._finish(reason)
        out = self.out
        out.output_ids.append(ev.token_id)
        out.logprobs.append(ev.logprob)
        out.token_texts.append(self.engine.decode([ev.token_id]))
        if ev.is_stop:
            return self._finish(self._stream.finish_reason)
        self._text_ids.append(ev.token_id)
        text = self.engine.decode(self._text_ids)
        if not text.endswith(REPLACEMENT_CHAR):
            self._emit(text[len(self._sent):])
            self._sent = text
        return Step.PROGRESSED

    def _finish(self, reason: str) -> Step:
        if self.cancelled.is_set():
            reason = "abort"
        self.out.finish_reason = reason
        self.out.text = self.engine.decode(self._text_ids)
        if len(self.out.text) > len(self._sent):
            self._emit(self.out.text[len(self._sent):])
        close = getattr(self._tokens, "close", None)
        if close is not None:
            close()  # a generator cut short: let it release what it holds now, not at collection
        return Step.DONE

    def result(self) -> Generated:
        return self.out


@dataclass
class Job:
    """One admitted generation as the event loop follows it."""

    wake: asyncio.Event
    task: GenerationTask
    deltas: list[str] = field(default_factory=list)
    cfut: Future | None = None
    fut: asyncio.Future | None = None

    def cancel(self) -> None:
        self.task.cancelled.set()
        self.cfut.cancel()  # still waiting: never starts


def client_gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


class GenerationRunner:
    """Interleaves generations of `engine` on one StepScheduler of at most `max_pending` requests."""

    def __init__(self, engine: GenerationEngine, max_pending: int, *, max_running: int = DEFAULT_MAX_RUNNING,
                 time_budget_s: float | None = DEFAULT_TIME_BUDGET_S):
        self.engine = engine
        self.time_budget_s = time_budget_s
        self.scheduler = StepScheduler("engine", max_pending, max_running)
        self.requests_served = 0

    @property
    def max_pending(self) -> int:
        return self.scheduler.max_pending

    def stop(self) -> None:
        self.scheduler.stop()

    def _served(self, fut: Future) -> None:
        if not fut.cancelled() and fut.exception() is None:
            self.requests_served += 1

    def submit(self, prompt_ids: list[int], params: SamplingParams, streaming: bool = False) -> Job:
        """Admit one generation (ServerBusy when the queue is full); `wait` then follows it."""
        loop = asyncio.get_running_loop()

        def push(delta: str) -> None:
            job.deltas.append(delta)
            job.wake.set()

        emit = (lambda d: loop.call_soon_threadsafe(push, d)) if streaming else None
        job = Job(wake=asyncio.Event(), task=GenerationTask(self.engine, prompt_ids, params, emit, self.time_budget_s))
        job.cfut = self.scheduler.submit(job.task)
        job.cfut.add_done_callback(self._served)
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
                taken = 0
                while job.deltas and on_delta is not None:
                    await on_delta(job.deltas.pop(0))
                    taken += 1
                if taken:
                    job.task.consumed += taken
                    self.scheduler.wake()  # a task paused on its backlog may go on
                if job.fut.done():
                    return job.fut.result()
                if client_gone(request):
                    raise ClientGone()
        except (ClientGone, ConnectionResetError, asyncio.CancelledError):
            job.cancel()
            raise

    async def run(self, request: web.Request, prompt_ids: list[int], params: SamplingParams) -> Generated:
        return await self.wait(request, self.submit(prompt_ids, params))
