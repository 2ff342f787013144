"""What a bench script records about how its result file was made (docs/benchmarks.md shows it).

`bench/render_benchmarks.py` prints a result file's `command` next to its table and refuses a block whose
marker names another command, so the command a reader sees is the one that wrote the numbers.
"""

from __future__ import annotations

import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def _script_path(argv0: str) -> str:
    """The script as run from the repository root (`bench/x.py`), however it was invoked."""
    path = Path(argv0).resolve()
    try:
        return str(path.relative_to(REPO_ROOT))
    except ValueError:
        return argv0


def command_line(argv: list[str] | None = None) -> str:
    argv = list(sys.argv if argv is None else argv)
    return shlex.join(["python", _script_path(argv[0]), *argv[1:]])


def git_commit() -> str | None:
    """The checkout's commit, or None where there is no git (the GPU machine gets a copy of the tree)."""
    try:
        out = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                             check=False, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def provenance(argv: list[str] | None = None) -> dict:
    """Fields every result file carries besides its measurements."""
    import torch

    return {
        "command": command_line(argv),
        "git_commit": git_commit(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "host_cpus": _cpu_count(),
        "torch_threads": torch.get_num_threads(),
        # Other jobs on a shared machine slow every timing: the load when the result was written says how busy.
        "host_load_average_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }


def _cpu_count() -> int | None:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def typed_argument(name: str, value) -> str:
    """One argparse option as it is typed (a flag alone, a list space-separated)."""
    flag = f"--{name.replace('_', '-')}"
    if value is True:
        return flag
    return f"{flag} {' '.join(map(str, value)) if isinstance(value, list) else value}"


def demo_cpu_header(script: str, args, skip: tuple[str, ...] = ("work_dir", "json")) -> dict:
    """The head of a demo-model CPU bench's result file: its command as typed (without `skip`, the options that only
    say where files go; unset flags and empty lists left out), the device, the machine and the model."""
    typed = " ".join(typed_argument(k, v) for k, v in vars(args).items() if k not in skip and v not in ([], False))
    return {
        "command": f"python {script} {typed}",
        "device": f"cpu ({os.cpu_count()} cores)",
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "device": "cpu"},
        "model": "demo (kimi_nvfp4/assets/tiny_k2)",
    }
