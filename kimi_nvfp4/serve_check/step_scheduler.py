"""One engine thread that runs every admitted generation a step (one token) at a time, round-robin.

The reference server used to run each request to its end before it looked at the next one: a
single `max_tokens: 200000, ignore_eos: true` request (or a streaming client that never read)
held the engine for as long as it ran, and every other request waited behind it. Here the thread
keeps up to `max_running` tasks active and advances each by one step per round, so a short request
that arrives behind a long one finishes after a few rounds, whatever the long one asked for.

Admission is bounded as before: at most `max_pending` tasks are held (running + waiting); one more
is refused at once with `ServerBusy` (SGLang's --max-queued-requests answer). A task may report
that it cannot progress (a streaming client that has not read what it was sent): it keeps its slot
but costs nothing, and the thread sleeps until some task is woken or a short poll ends (so that
time budgets are still checked for paused tasks).

The thread is a daemon: a process told to stop exits even while a step is inside a long forward.
"""

from __future__ import annotations

import enum
import threading
from collections import deque
from concurrent.futures import Future
from typing import Any, Protocol

from .engine_worker import RequestCancelled, refuse_when_full

# Generations interleaved at once (SGLang's --max-running-requests); each holds its own KV cache,
# so this bounds memory as well as how thin the engine's time is sliced.
DEFAULT_MAX_RUNNING = 4
# While every running task is paused, how long the thread sleeps before it looks again (so a paused
# task's time budget and cancellation are noticed without a wake-up).
PAUSED_POLL_S = 0.05


class Step(enum.Enum):
    PROGRESSED = "progressed"
    PAUSED = "paused"  # waiting for its consumer; try again next round
    DONE = "done"


class StepTask(Protocol):
    cancelled: threading.Event

    def step(self) -> Step: ...

    def result(self) -> Any: ...


class StepScheduler:
    def __init__(self, name: str, max_pending: int, max_running: int = DEFAULT_MAX_RUNNING):
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        if max_running < 1:
            raise ValueError(f"max_running must be >= 1, got {max_running}")
        self.max_pending = max_pending
        self.max_running = max_running
        self.stopping = threading.Event()
        self._cond = threading.Condition()
        self._waiting: deque[tuple[Future, StepTask]] = deque()
        self._running: list[tuple[Future, StepTask]] = []
        self._tasks: set[StepTask] = set()  # every held task, to cancel them all on stop
        self._pending = 0
        self._woken = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    @property
    def pending(self) -> int:
        with self._cond:
            return self._pending

    def submit(self, task: StepTask) -> Future:
        """Hold `task` until it is DONE; its future gets `task.result()` (ServerBusy when full)."""
        with self._cond:
            refuse_when_full(self.stopping, self._pending, self.max_pending)
            self._pending += 1
            self._tasks.add(task)
            fut: Future = Future()
            self._waiting.append((fut, task))
            self._cond.notify()
        fut.add_done_callback(lambda _: self._release(task))
        return fut

    def wake(self) -> None:
        """A paused task may progress again (its consumer caught up)."""
        with self._cond:
            self._woken = True
            self._cond.notify()

    def _release(self, task: StepTask) -> None:
        with self._cond:
            self._pending -= 1
            self._tasks.discard(task)

    def _admit(self) -> None:
        """Under the lock: move waiting tasks into free running slots (dropping cancelled ones)."""
        while self._waiting and len(self._running) < self.max_running:
            fut, task = self._waiting.popleft()
            if not fut.set_running_or_notify_cancel():
                continue  # its client left while it waited
            if task.cancelled.is_set():
                fut.set_exception(RequestCancelled("cancelled before it started"))
                continue
            self._running.append((fut, task))

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._admit()
                if not self._running:
                    if self.stopping.is_set() and not self._waiting:
                        return
                    self._cond.wait()
                    continue
                running = list(self._running)
            # steps run outside the lock: submit() and wake() never wait for a forward pass
            progressed = False
            for item in running:
                fut, task = item
                try:
                    state = task.step()
                    if state is Step.DONE:
                        fut.set_result(task.result())
                except BaseException as e:  # handed to the waiting request, which reports it
                    state = Step.DONE
                    fut.set_exception(e)
                if state is Step.DONE:
                    with self._cond:
                        self._running.remove(item)
                progressed |= state is not Step.PAUSED
            if not progressed:
                with self._cond:
                    if not self._woken:
                        self._cond.wait(PAUSED_POLL_S)
                    self._woken = False

    def stop(self) -> None:
        """Tell every task to stop at its next step and refuse new ones; the thread then ends."""
        with self._cond:
            self.stopping.set()
            for task in self._tasks:
                task.cancelled.set()
            self._cond.notify()
