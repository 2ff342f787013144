"""Pick the compute device (shared by calibrate and validate) and calibrate's compute dtype."""

from __future__ import annotations

import time

import torch

from ..errors import DeviceError
from .device_type import AUTO_DEVICE, DEVICE_TYPES, VOCABULARY

AUTO_DTYPE = "auto"


def resolve_device(device: str | torch.device) -> torch.device:
    """`auto` -> the first CUDA device if there is one, else CPU; `cpu`, `cuda`, `cuda:N`; an explicit CUDA
    request needs CUDA. The one device rule of every stage (convert, calibrate, validate, requantize); options
    models check the spelling first (`device_type.Device`), this checks the machine."""
    if str(device) == AUTO_DEVICE:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise DeviceError(f"--device must be {VOCABULARY}, got {device!r}") from None
    if dev.type not in DEVICE_TYPES:
        raise DeviceError(f"--device must be {VOCABULARY}, got {device!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise DeviceError(f"--device {device}: torch sees no CUDA device on this machine (use --device cpu)")
    return dev


def synchronize(device: torch.device) -> None:
    """Wait for the kernels queued on the current stream (for honest timings). Not the whole device: the
    next layer's uploads on the runner's load stream keep running (runner.py)."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


class PhaseClock:
    """Wall seconds per named phase of one layer (`mark(name)` ends the phase begun at the previous mark),
    each ended by a wait for the compute stream: where a model stage's layer time goes."""

    def __init__(self, device: torch.device):
        self.device, self.seconds, self._start = device, {}, time.perf_counter()

    def mark(self, phase: str) -> None:
        synchronize(self.device)
        now = time.perf_counter()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - self._start
        self._start = now


# Compute dtypes of the layer-streamed model, by the names the CLI and the manifest use.
COMPUTE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16"}


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """`auto` -> bfloat16 on CUDA (what SGLang serves: bf16 hidden states, bf16 tensor-core matmuls),
    float32 on CPU (exact reference, and CPUs have no fast bf16 matmul); else the named dtype."""
    if isinstance(dtype, torch.dtype):
        if dtype not in COMPUTE_DTYPES.values():
            raise ValueError(f"compute dtype must be one of {sorted(COMPUTE_DTYPES)}, got {dtype}")
        return dtype
    name = _DTYPE_ALIASES.get(str(dtype).lower(), str(dtype).lower())
    if name == AUTO_DTYPE:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in COMPUTE_DTYPES:
        raise ValueError(f"dtype must be auto, {', '.join(COMPUTE_DTYPES)}; got {dtype!r}")
    return COMPUTE_DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.bfloat16` -> "bfloat16" (the name recorded in reports and the manifest)."""
    return str(dtype).removeprefix("torch.")
