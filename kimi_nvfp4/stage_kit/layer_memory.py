"""Per-layer peak memory of the model stages (calibrate, validate): what the layer loop records beside its seconds.

Per layer, `LayerMemory` records
- `gpu_peak_bytes`: the most GPU memory the process had allocated (`torch.cuda.max_memory_allocated`) while the
  layer ran, the peak counter being reset when the layer starts; None (the whole list) on CPU;
- `host_peak_rss_bytes`: the process's peak resident set size SO FAR (`getrusage(RUSAGE_SELF).ru_maxrss`), a
  running maximum over the whole process (everything before the layer included): it never decreases, and a layer
  that needs less than an earlier one shows the earlier peak.
Under torchrun each rank measures its own process and device; the reports carry rank 0's.

Resetting CUDA's peak counter per layer would hide the run's peak from anyone reading
`torch.cuda.max_memory_allocated` after the stage (the benches, the memory-plan checks): `reset_peak` and
`peak_allocated` / `peak_reserved` below keep the peak since the caller's own reset across the per-layer resets.
"""

from __future__ import annotations

import sys

import torch
from pydantic import BaseModel, ConfigDict, Field

try:
    import resource
except ImportError:  # Windows: no getrusage
    resource = None

# the peaks (allocated, reserved) seen before the per-layer resets, by CUDA device index, since `reset_peak`
_carried: dict[int, tuple[int, int]] = {}


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def host_peak_rss_bytes() -> int | None:
    """The process's maximum resident set size so far, in bytes (Linux reports KiB, macOS bytes); None without
    getrusage."""
    if resource is None:
        return None
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def _reset_layer_peak(device: torch.device) -> None:
    """Reset CUDA's peak counters for one layer, carrying what they held into the run's peak."""
    i = _index(device)
    a, r = _carried.get(i, (0, 0))
    _carried[i] = (max(a, torch.cuda.max_memory_allocated(device)), max(r, torch.cuda.max_memory_reserved(device)))
    torch.cuda.reset_peak_memory_stats(device)


def reset_peak(device: str | torch.device) -> None:
    """`torch.cuda.reset_peak_memory_stats` for a caller that measures a whole stage: starts its peak afresh."""
    device = torch.device(device)
    _carried.pop(_index(device), None)
    torch.cuda.reset_peak_memory_stats(device)


def peak_allocated(device: str | torch.device) -> int:
    """The peak allocated GPU bytes since `reset_peak`, across the layer loops' per-layer resets."""
    device = torch.device(device)
    return max(_carried.get(_index(device), (0, 0))[0], torch.cuda.max_memory_allocated(device))


def peak_reserved(device: str | torch.device) -> int:
    """The peak reserved GPU bytes since `reset_peak`, across the layer loops' per-layer resets."""
    device = torch.device(device)
    return max(_carried.get(_index(device), (0, 0))[1], torch.cuda.max_memory_reserved(device))


class LayerMemory(BaseModel):
    """Per layer, in the order the layers ran: peak GPU bytes allocated during the layer (None on CPU) and the
    process's peak RSS so far (a running maximum). Kept in the run, the resume snapshots and the stage reports."""

    model_config = ConfigDict(extra="forbid")

    gpu_peak_bytes: list[int] | None = None  # CUDA only: max_memory_allocated while the layer ran
    # the process's ru_maxrss so far at the end of each layer (never decreases; includes everything before it)
    host_peak_rss_bytes: list[int | None] = Field(default_factory=list)

    def start(self, device: torch.device) -> None:
        """At the start of a layer: reset CUDA's peak counter (nothing on CPU)."""
        if device.type == "cuda":
            _reset_layer_peak(device)

    def stop(self, device: torch.device) -> None:
        """At the end of a layer (after the device was synchronized): record both figures."""
        if device.type == "cuda":
            if self.gpu_peak_bytes is None:
                self.gpu_peak_bytes = []
            self.gpu_peak_bytes.append(int(torch.cuda.max_memory_allocated(device)))
        self.host_peak_rss_bytes.append(host_peak_rss_bytes())


__all__ = ["LayerMemory", "host_peak_rss_bytes", "peak_allocated", "peak_reserved", "reset_peak"]
