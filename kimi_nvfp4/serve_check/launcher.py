"""Run a server as a subprocess: captured log, readiness polling, fail-fast on fatal log lines, teardown.

The server runs in its own process group (`start_new_session=True`) so teardown reaches SGLang's
scheduler and detokenizer children too; `stop()` runs from `__exit__`, which Python also runs on
Ctrl-C (KeyboardInterrupt unwinds through the `with` block).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import KimiNvfp4Error

READY_PATH = "/health_generate"  # SGLang: 200 only once a real one-token generation succeeded
DEFAULT_READY_TIMEOUT_S = 1800.0  # loading 595 GB and capturing CUDA graphs takes many minutes
POLL_INTERVAL_S = 1.0
HEALTH_REQUEST_TIMEOUT_S = 10.0
TERMINATE_GRACE_S = 20.0
QUOTED_CONTEXT_LINES = 3
LOG_TAIL_LINES = 20

# Lines after which an SGLang server will never become healthy. Quoted verbatim in the error.
FATAL_LOG_PATTERNS: tuple[str, ...] = (
    r"CUDA out of memory",
    r"torch\.OutOfMemoryError",
    r"an illegal memory access was encountered",
    r"CUDA error: ",
    r"size mismatch for ",
    r"(?i)error (?:while |when |in )?loading (?:the )?(?:model )?weights",
    r"KeyError: '[^']*(?:weight|scale)[^']*'",
    r"Scheduler hit an exception",
    r"(?i)not enough memory",
    r"Address already in use",
)



def terminate_process_group(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM `proc`'s process group (it leads its own session), SIGKILL it if it has not ended after `grace_s`."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace_s)
            return
        except subprocess.TimeoutExpired:
            continue

class ServerLaunchError(KimiNvfp4Error):
    """The server process died, logged a fatal error, or never became ready."""

    exit_code = 6


@dataclass
class ManagedServer:
    """A server subprocess. Use as a context manager: `with ManagedServer(...) as s: s.wait_ready()`."""

    command: Sequence[str]
    base_url: str
    log_path: Path
    ready_timeout_s: float = DEFAULT_READY_TIMEOUT_S
    fatal_patterns: Sequence[str] = FATAL_LOG_PATTERNS
    env: dict[str, str] | None = None
    poll_interval_s: float = POLL_INTERVAL_S
    _proc: subprocess.Popen | None = field(default=None, init=False, repr=False)
    _log_offset: int = field(default=0, init=False, repr=False)
    _pending: str = field(default="", init=False, repr=False)
    _compiled: list[re.Pattern] = field(default_factory=list, init=False, repr=False)

    def start(self) -> None:
        self._compiled = [re.compile(p) for p in self.fatal_patterns]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **(self.env or {})}
        with open(self.log_path, "wb") as log:
            self._proc = subprocess.Popen(
                list(self.command), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=env, start_new_session=True,
            )

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def _new_log_lines(self) -> list[str]:
        with open(self.log_path, "rb") as f:
            f.seek(self._log_offset)
            chunk = f.read()
        self._log_offset += len(chunk)
        text = self._pending + chunk.decode("utf-8", errors="replace")
        lines = text.split("\n")
        self._pending = lines.pop()  # a partial last line waits for its end
        return lines

    def log_tail(self, n: int = LOG_TAIL_LINES) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except FileNotFoundError:
            return ""
        return "\n".join(lines[-n:])

    def check_log(self) -> None:
        """Raise ServerLaunchError quoting the first fatal line (plus a few after it) seen since last call."""
        lines = self._new_log_lines()
        if not self.running() and self._pending:  # a dead process will not finish its last line
            lines.append(self._pending)
            self._pending = ""
        for i, line in enumerate(lines):
            if any(p.search(line) for p in self._compiled):
                quoted = "\n".join(x.rstrip() for x in lines[i : i + 1 + QUOTED_CONTEXT_LINES])
                raise ServerLaunchError(f"server failed (log {self.log_path}):\n{quoted}")

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.base_url + READY_PATH, timeout=HEALTH_REQUEST_TIMEOUT_S) as r:
                return r.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            return False

    def wait_ready(self) -> float:
        """Poll until GET /health_generate is 200; return seconds waited. Fails fast on death or fatal logs."""
        if self._proc is None:
            raise ServerLaunchError("wait_ready() before start()")
        t0 = time.monotonic()
        deadline = t0 + self.ready_timeout_s
        while True:
            self.check_log()
            code = self._proc.poll()
            if code is not None:
                self.check_log()
                raise ServerLaunchError(
                    f"server exited with code {code} before becoming ready (log {self.log_path}):\n{self.log_tail()}"
                )
            if self.healthy():
                return time.monotonic() - t0
            if time.monotonic() >= deadline:
                raise ServerLaunchError(
                    f"server not ready after {self.ready_timeout_s:.0f} s ({self.base_url}{READY_PATH}); "
                    f"log {self.log_path} ends:\n{self.log_tail()}"
                )
            time.sleep(self.poll_interval_s)

    def stop(self) -> int | None:
        """SIGTERM the whole process group, SIGKILL after a grace period. Safe to call twice."""
        proc = self._proc
        if proc is None:
            return None
        if proc.poll() is None:
            terminate_process_group(proc, TERMINATE_GRACE_S)
        else:
            # the leader is gone but children it spawned may linger in its group
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        return proc.returncode

    def __enter__(self) -> ManagedServer:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
