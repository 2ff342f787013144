"""Every change made so that an engine's own code runs on a CPU, recorded for the report.

Rule: patch only what a CPU forces (a missing CUDA-only package, a device query, a GPU kernel), never
a decision the engine makes about the checkpoint. Each patch is scoped (restored on exit) and logged
as a `CpuPatch`: what was replaced, why the CPU forces it, and what it means for the check's verdict.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from .report import CpuPatch
from .torchvision_standin import install_torchvision_standin, torchvision_import_error

_MISSING = object()


class PatchLog:
    def __init__(self) -> None:
        self.patches: list[CpuPatch] = []

    def record(self, target: str, why: str, effect: str) -> None:
        if not any(p.target == target for p in self.patches):
            self.patches.append(CpuPatch(target=target, why=why, effect=effect))

    @contextmanager
    def attribute(self, owner: Any, name: str, value: Any, *, target: str, why: str, effect: str) -> Iterator[None]:
        """Set `owner.name = value` for the duration, log it, and restore the original (or its absence)."""
        before = owner.__dict__.get(name, _MISSING) if hasattr(owner, "__dict__") else getattr(owner, name, _MISSING)
        setattr(owner, name, value)
        self.record(target, why, effect)
        try:
            yield
        finally:
            if before is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, before)


def ensure_torchvision(log: PatchLog) -> None:
    """Import the real torchvision, or install the stand-in (engine_check/torchvision_standin.py) and log why."""
    error = torchvision_import_error()
    if error is None:
        return
    install_torchvision_standin()
    log.record(
        "torchvision (whole package)",
        f"the installed torchvision does not import on this machine ({error[:160]}); the engines import it at "
        "module level in their multimodal configs and processors",
        "a stand-in module: InterpolationMode is real, every other attribute raises when called; loading weights "
        "never processes an image",
    )
