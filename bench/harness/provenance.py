"""What a bench script records about how its result file was made (docs/benchmarks.md shows it).

Every result file carries `command` (the script as `python -m bench.<kind>.<name> ARGS`, however it was started),
`git_commit` (read from git when the script started, never typed by hand), `host`, `device` and the software and
load figures below. `bench/render_benchmarks.py` prints a result file's `command` next to its table and refuses a
block whose marker names another command, so the command a reader sees is the one that wrote the numbers.
"""

from __future__ import annotations

import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def script_module(argv0: str) -> str | None:
    """`bench.speed.convert` for `bench/speed/convert.py` (however it was invoked); None outside bench/."""
    path = Path(argv0).resolve()
    try:
        rel = path.relative_to(REPO_ROOT)
    except ValueError:
        return None
    if rel.parts[:1] != ("bench",) or rel.suffix != ".py":
        return None
    return ".".join(rel.with_suffix("").parts)


def script_invocation(argv0: str | None = None) -> list[str]:
    """How the running script is started from the repository root: `["python", "-m", "bench.x.y"]`."""
    argv0 = sys.argv[0] if argv0 is None else argv0
    module = script_module(argv0)
    return ["python", "-m", module] if module else ["python", argv0]


def command_line(argv: list[str] | None = None) -> str:
    argv = list(sys.argv if argv is None else argv)
    return shlex.join([*script_invocation(argv[0]), *argv[1:]])


def git_commit() -> str | None:
    """The checkout's commit, or None where there is no git (the GPU machine gets a copy of the tree)."""
    try:
        out = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                             check=False, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


# Read once, when the script starts (this module is imported at launch), so a commit made while a long run is
# going does not end up in its result file.
LAUNCH_COMMIT = git_commit()


def device_name(device=None) -> str:
    """The device a run measured: the GPU's name for CUDA, `cpu (N cores)` otherwise."""
    import torch

    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dev.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(dev)
    return f"cpu ({_cpu_count()} cores)"


def provenance(argv: list[str] | None = None, device=None) -> dict:
    """Fields every result file carries besides its measurements (`device` only when given: a script that records
    its own device field keeps it)."""
    import torch

    record = {
        "command": command_line(argv),
        "git_commit": LAUNCH_COMMIT,
        "host": platform.node(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "host_cpus": _cpu_count(),
        "torch_threads": torch.get_num_threads(),
        # Other jobs on a shared machine slow every timing: the load when the result was written says how busy.
        "host_load_average_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }
    if device is not None:
        record["device"] = device_name(device)
    return record


def _cpu_count() -> int | None:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def typed_argument(name: str, value) -> str:
    """One argparse option as it is typed (a flag alone, a list space-separated, a value with spaces quoted)."""
    flag = f"--{name.replace('_', '-')}"
    if value is True:
        return flag
    return shlex.join([flag, *map(str, value if isinstance(value, list) else [value])])


def demo_cpu_header(args, skip: tuple[str, ...] = ("work_dir", "json")) -> dict:
    """The head of a demo-model CPU bench's result file: its command as typed (without `skip`, the options that only
    say where files go; unset flags and empty lists left out), the device, the machine, the model, the commit and
    the host."""
    typed = " ".join(typed_argument(k, v) for k, v in vars(args).items() if k not in skip and v not in ([], False))
    return {
        "command": " ".join([*script_invocation(), typed]).strip(),
        "device": f"cpu ({os.cpu_count()} cores)",
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "device": "cpu"},
        "model": "demo (kimi_nvfp4/assets/tiny_k2)",
        "git_commit": LAUNCH_COMMIT,
        "host": platform.node(),
    }
