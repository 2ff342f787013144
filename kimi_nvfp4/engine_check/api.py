"""`check_engine`: will SGLang (or vLLM) load this converted checkpoint as we mean it? Answered by the engine's
own code on a CPU, before anyone rents a Blackwell GPU. See docs/engine_check.md.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

from ..checkpoint.reader import INDEX_NAME
from ..errors import CheckpointError, EngineUnavailableError, KimiNvfp4Error, OutputError
from .checkpoint_view import CheckpointView
from .full_size import LISTING_NAME, read_listing
from .report import BuildDevice, Engine, EngineCheckReport
from .sglang_session import MOE_BACKEND_FOR_SCHEME, MOE_BACKENDS
from .worker import CheckAnswer, CheckRequest

DEVICES = ("auto", "cpu", "meta")
# "auto" builds on the CPU up to this many checkpoint bytes (the model then needs about as much RAM again
# for its parameters); above it, the meta device (shapes, routing and quant methods; no values).
MAX_CPU_CHECKPOINT_BYTES = 16 * 2**30
REPORT_SUBDIR = "reports"
# The child process reports a user-facing error as (message, exit code); the same type is raised here.
_ERROR_TYPES: dict[int, type[KimiNvfp4Error]] = {
    CheckpointError.exit_code: CheckpointError,
    OutputError.exit_code: OutputError,
    EngineUnavailableError.exit_code: EngineUnavailableError,
}


def resolve_device(device: str, view: CheckpointView) -> BuildDevice:
    if device not in DEVICES:
        raise KimiNvfp4Error(f"--device must be one of {DEVICES}, got {device!r}")
    if device == "auto":
        size = sum(i.nbytes for i in view.tensors.values())
        return BuildDevice.CPU if view.has_shard_files and size <= MAX_CPU_CHECKPOINT_BYTES else BuildDevice.META
    if device == "cpu" and not view.has_shard_files:
        raise KimiNvfp4Error("--device cpu needs the shard files; a tensor listing can only be checked on meta")
    return BuildDevice(device)


def check_engine(
    checkpoint: str | Path,
    engine: Engine | str = Engine.SGLANG,
    *,
    device: str = "auto",
    moe_runner_backend: str = MOE_BACKEND_FOR_SCHEME,
    listing: str | Path | None = None,
    report_dir: str | Path | None = None,
) -> EngineCheckReport:
    """Run `engine`'s model building and weight loading over `checkpoint` in a child process; save and return the report.

    :param checkpoint: a converted (and possibly calibrated) checkpoint folder, or with `listing` a folder
        holding only config.json / hf_quant_config.json (full_size.write_full_size_checkpoint)
    :param device: "cpu" (values: sentinel audit, value checks), "meta" (shapes only), or "auto"
    :param moe_runner_backend: SGLang's --moe-runner-backend; "for-scheme": SGLang's pick on SM100 for a W4A4
        checkpoint (flashinfer_trtllm), marlin for a weight-only one
    :param report_dir: where engine_check_<engine>.{json,md} go (default CHECKPOINT/reports)
    :raises CheckpointError: the folder is not a converted checkpoint (exit 3)
    :raises EngineUnavailableError: the engine is not installed or does not import (exit 8)
    """
    engine = Engine(engine)
    if moe_runner_backend not in MOE_BACKENDS:
        raise KimiNvfp4Error(f"--moe-runner-backend must be one of {MOE_BACKENDS}, got {moe_runner_backend!r}")
    root = Path(checkpoint).expanduser().resolve()
    if listing is None and (root / LISTING_NAME).is_file() and not (root / INDEX_NAME).is_file():
        listing = root / LISTING_NAME  # a folder written by `check-engine --full-size`
    if listing is not None:
        view = CheckpointView.from_listing(root, read_listing(listing))
    else:
        view = CheckpointView.from_folder(root)
    _ = view.declared_scheme  # a malformed quant_algo fails here (exit 3), before an engine is imported
    build = resolve_device(device, view)
    with tempfile.TemporaryDirectory(prefix="kimi-nvfp4-engine-check-") as tmp:
        answer_path = Path(tmp) / "answer.json"
        request = CheckRequest(
            checkpoint=str(root), engine=engine, device=build, moe_runner_backend=moe_runner_backend,
            listing=str(Path(listing).resolve()) if listing is not None else None, answer=str(answer_path),
        )
        request_path = Path(tmp) / "request.json"
        request_path.write_text(request.model_dump_json())
        proc = subprocess.run([sys.executable, "-m", "kimi_nvfp4.engine_check.worker", str(request_path)], check=False)
        if not answer_path.is_file():
            raise RuntimeError(f"the {engine.value} check process ended with code {proc.returncode} and no answer")
        answer = CheckAnswer.model_validate_json(answer_path.read_text())
    if answer.error is not None:
        raise _ERROR_TYPES.get(answer.exit_code, KimiNvfp4Error)(answer.error)
    report = answer.report
    report.save(Path(report_dir) if report_dir is not None else root / REPORT_SUBDIR)
    return report
