"""Does this machine fit a serving profile? Asked of `nvidia-smi` before SGLang spends minutes loading."""

from __future__ import annotations

import csv
import io
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from ..errors import DeviceError
from .profiles import ServeProfile

NVIDIA_SMI_QUERY = ["--query-gpu=name,compute_cap,memory.total", "--format=csv,noheader,nounits"]
NVIDIA_SMI_TIMEOUT_S = 30
MIB_PER_GIB = 1024
# Weights may take at most this share of the profile's total GPU memory; the rest is KV cache,
# activations and CUDA graphs (SGLang's --mem-fraction-static defaults to ~0.8-0.9 of each GPU).
MAX_WEIGHT_FRACTION = 0.8


@dataclass(frozen=True)
class GpuInfo:
    name: str
    compute_cap: str
    memory_gib: float


def parse_nvidia_smi_csv(text: str) -> list[GpuInfo]:
    """Parse `nvidia-smi --query-gpu=name,compute_cap,memory.total --format=csv[,noheader][,nounits]`."""
    gpus: list[GpuInfo] = []
    for row in csv.reader(io.StringIO(text)):
        cells = [c.strip() for c in row]
        if not cells or not any(cells):
            continue
        if cells[0] == "name":  # header line when noheader was not given
            continue
        if len(cells) != 3:
            raise DeviceError(f"nvidia-smi: expected 'name, compute_cap, memory.total' per line, got {row!r}")
        name, cap, mem = cells
        mem_mib = mem.split()[0]  # "183359 MiB" when nounits was not given
        try:
            gpus.append(GpuInfo(name, cap, float(mem_mib) / MIB_PER_GIB))
        except ValueError:
            raise DeviceError(f"nvidia-smi: memory.total {mem!r} of GPU {name!r} is not a number") from None
    return gpus


def query_gpus(nvidia_smi: str = "nvidia-smi") -> list[GpuInfo]:
    exe = shutil.which(nvidia_smi)
    if exe is None:
        raise DeviceError("no NVIDIA GPU visible: `nvidia-smi` is not on PATH (use --url to check a running server)")
    try:
        done = subprocess.run([exe, *NVIDIA_SMI_QUERY], capture_output=True, text=True, timeout=NVIDIA_SMI_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise DeviceError(f"nvidia-smi did not answer within {NVIDIA_SMI_TIMEOUT_S} s") from None
    if done.returncode != 0:
        raise DeviceError(f"nvidia-smi failed (exit {done.returncode}): {done.stderr.strip() or done.stdout.strip()}")
    return parse_nvidia_smi_csv(done.stdout)


def checkpoint_weight_gib(checkpoint: str | Path) -> float:
    return sum(p.stat().st_size for p in Path(checkpoint).glob("*.safetensors")) / MIB_PER_GIB**3


def fit_problems(profile: ServeProfile, gpus: list[GpuInfo], weight_gib: float = 0.0) -> list[str]:
    """Everything that keeps `profile` from running on `gpus`; empty when it fits."""
    req = profile.gpus
    problems: list[str] = []
    if len(gpus) < req.count:
        problems.append(f"needs {req.count} GPUs, found {len(gpus)}")
    usable = gpus[: req.count]
    wrong_arch = [g for g in usable if g.compute_cap not in req.compute_caps]
    if wrong_arch:
        seen = sorted({f"{g.name} (compute capability {g.compute_cap})" for g in wrong_arch})
        problems.append(
            f"needs {req.architecture}, compute capability {' or '.join(req.compute_caps)}; found {', '.join(seen)}"
        )
    small = [g for g in usable if g.memory_gib < req.min_memory_gib]
    if small:
        problems.append(
            f"needs >= {req.min_memory_gib:.0f} GiB per GPU; found {min(g.memory_gib for g in small):.0f} GiB"
        )
    total = sum(g.memory_gib for g in usable)
    if weight_gib and usable and weight_gib > MAX_WEIGHT_FRACTION * total:
        problems.append(
            f"checkpoint weights {weight_gib:.0f} GiB exceed {MAX_WEIGHT_FRACTION:.0%} of the "
            f"{total:.0f} GiB on {len(usable)} GPUs (no room for the KV cache)"
        )
    return problems


def check_gpu_fit(profile: ServeProfile, gpus: list[GpuInfo] | None = None, weight_gib: float = 0.0) -> list[GpuInfo]:
    """Raise DeviceError naming everything missing for `profile`; return the GPUs it will use."""
    gpus = query_gpus() if gpus is None else gpus
    problems = fit_problems(profile, gpus, weight_gib)
    if problems:
        raise DeviceError(f"profile {profile.name} does not fit this machine: " + "; ".join(problems))
    return gpus[: profile.gpus.count]
