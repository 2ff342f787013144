"""One thread that runs engine jobs in order, a bounded queue in front of it, and cancellation.

The emulator serves one request at a time. `EngineWorker` admits at most `max_pending` requests
(running + waiting); one more is refused at once with `ServerBusy` (SGLang's --max-queued-requests
answers "The request queue is full." with 503). Each job gets a `threading.Event` it polls
between tokens: set when its client goes away, and for every job when the server stops.

The thread is a daemon: a process told to stop (SIGTERM/SIGINT) exits even while a long prefill
is in a single forward call, after the jobs were told to stop.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from .server_requests import ServerBusy

# Requests the reference server holds at once (one running, the rest waiting), unless told otherwise.
DEFAULT_MAX_PENDING = 16



def refuse_when_full(stopping: threading.Event, pending: int, max_pending: int) -> None:
    """The admission rule of every bounded queue of the reference server (called under the queue's lock): refuse
    while shutting down or at `max_pending`, with SGLang's --max-queued-requests answer (ServerBusy, HTTP 503)."""
    if stopping.is_set():
        raise ServerBusy("The server is shutting down.")
    if pending >= max_pending:
        raise ServerBusy(f"The request queue is full. ({pending} requests pending, limit {max_pending})")

class RequestCancelled(Exception):
    """The request was cancelled (client gone, server stopping) before the engine started it."""


class EngineWorker:
    def __init__(self, name: str, max_pending: int = DEFAULT_MAX_PENDING):
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        self.max_pending = max_pending
        self.stopping = threading.Event()
        self._jobs: queue.SimpleQueue[tuple[Future, Callable[..., Any], tuple, threading.Event] | None] = \
            queue.SimpleQueue()
        self._lock = threading.Lock()
        self._pending = 0
        self._cancel_events: set[threading.Event] = set()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    @property
    def pending(self) -> int:
        with self._lock:
            return self._pending

    def submit(self, fn: Callable[..., Any], *args: Any) -> tuple[Future, threading.Event]:
        """Queue `fn(*args, cancelled)`; returns its future and its cancel event (ServerBusy when full)."""
        cancelled = threading.Event()
        with self._lock:
            refuse_when_full(self.stopping, self._pending, self.max_pending)
            self._pending += 1
            self._cancel_events.add(cancelled)
        fut: Future = Future()
        fut.add_done_callback(lambda _: self._release(cancelled))
        self._jobs.put((fut, fn, args, cancelled))
        return fut, cancelled

    def _release(self, cancelled: threading.Event) -> None:
        with self._lock:
            self._pending -= 1
            self._cancel_events.discard(cancelled)

    def _loop(self) -> None:
        while (item := self._jobs.get()) is not None:
            fut, fn, args, cancelled = item
            if not fut.set_running_or_notify_cancel():
                continue  # cancelled while waiting
            if cancelled.is_set():
                fut.set_exception(RequestCancelled("cancelled before it started"))
                continue
            try:
                fut.set_result(fn(*args, cancelled))
            except BaseException as e:  # handed to the waiting request, which reports it
                fut.set_exception(e)

    def stop(self) -> None:
        """Tell every job to stop at its next token and refuse new ones; the thread then ends."""
        with self._lock:
            self.stopping.set()
            for event in self._cancel_events:
                event.set()
        self._jobs.put(None)
