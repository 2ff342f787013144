"""Error types shared by every stage, and the one mapping from an exception to a process exit code.

Every error a user can cause names the file, the tensor and what was expected, and maps to a
distinct process exit code so CI jobs can gate on it. Anything else escaping a command is a bug:
exit 70 (`INTERNAL_ERROR_EXIT_CODE`) with its traceback, for every command alike (`exit_code_for`,
used by the console entry point `kimi_nvfp4/cli.py` and by `run`'s per-stage outcomes).
"""

from __future__ import annotations

from pathlib import Path


class KimiNvfp4Error(Exception):
    """Base class: a problem the user can act on (bad input, failed gate, refused operation)."""

    exit_code = 2


class CheckpointError(KimiNvfp4Error):
    """A checkpoint file or tensor is missing, malformed or not what the config promises."""

    exit_code = 3

    def __init__(self, message: str, *, file: str | Path | None = None, tensor: str | None = None):
        self.file = str(file) if file is not None else None
        self.tensor = tensor
        where = []
        if self.file:
            where.append(f"file {self.file}")
        if tensor:
            where.append(f"tensor {tensor}")
        prefix = f"{', '.join(where)}: " if where else ""
        super().__init__(prefix + message)


class UnsupportedCheckpointError(CheckpointError):
    """The checkpoint is readable but in a format or quantization scheme we refuse to convert."""


class OutputError(KimiNvfp4Error):
    """The output location is unusable (holds other content, settings differ, disk full)."""

    exit_code = 4


class GateFailure(KimiNvfp4Error):
    """A validation or serving gate failed; the report says which and by how much."""

    exit_code = 1


class DeviceError(KimiNvfp4Error):
    """Asked-for hardware is absent or does not fit (no CUDA, wrong GPU for a serving profile)."""

    exit_code = 5


# BSD sysexits EX_SOFTWARE: an exception that is not a KimiNvfp4Error is a bug in kimi-nvfp4, not bad input.
INTERNAL_ERROR_EXIT_CODE = 70


def exit_code_for(error: BaseException) -> int:
    """The process exit code for an exception that ends a command (README "Exit codes")."""
    return error.exit_code if isinstance(error, KimiNvfp4Error) else INTERNAL_ERROR_EXIT_CODE


class ResourceError(KimiNvfp4Error):
    """The job does not fit the memory (or disk) it may use: the message gives the plan, what it needs and what
    would fit (stage_kit/memory_plan.py). Raised before any weight is read, or when the device runs out anyway."""

    exit_code = 10


class EngineUnavailableError(KimiNvfp4Error):
    """A serving engine the command drives (check-engine) is not installed or cannot be imported here."""

    exit_code = 8


class EngineProcessError(KimiNvfp4Error):
    """A serving engine's check process (check-engine's child) ended without an answer: killed, out of memory, or
    aborted inside the engine. The message names its exit code (negative: the signal)."""

    exit_code = 11
