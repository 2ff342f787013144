"""Pick the compute device for the layer-streamed model (shared by calibrate and validate)."""

from __future__ import annotations

import torch

from ..errors import DeviceError

AUTO_DEVICE = "auto"


def resolve_device(device: str | torch.device) -> torch.device:
    """`auto` -> the first CUDA device if there is one, else CPU; an explicit CUDA request needs CUDA."""
    if str(device) == AUTO_DEVICE:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise DeviceError(f"--device {device}: CUDA is not available on this machine (use --device cpu)")
    return dev


def synchronize(device: torch.device) -> None:
    """Wait for queued kernels (for honest timings)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
