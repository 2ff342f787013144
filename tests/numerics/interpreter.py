"""Running a checks module under Triton's CPU interpreter, in a child process (the interpreter is chosen when kernels
are defined, so it cannot be switched on inside the test process)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HAS_TRITON = importlib.util.find_spec("triton") is not None
requires_triton = pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed (it comes with CUDA builds of torch)")


def run_under_interpreter(module: str, timeout: int = 600) -> str:
    """`python -m module` with TRITON_INTERPRET=1 from the repository root; its stdout (fails on a non-zero exit)."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-m", module], env=env, capture_output=True, text=True, timeout=timeout,
                         cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout
