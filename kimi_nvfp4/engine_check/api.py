"""`check_engine`: will SGLang (or vLLM) load this converted checkpoint as we mean it? Answered by the engine's
own code on a CPU, before anyone rents a Blackwell GPU. See docs/engine_check.md.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..checkpoint.reader import INDEX_NAME
from ..checkpoint.scheme_journal import recover_scheme_switch
from ..errors import CheckpointError, EngineProcessError, EngineUnavailableError, KimiNvfp4Error, OutputError
from ..plugins import PluginError
from ..stage_kit.output_paths import require_writable_dir
from .checkpoint_view import CheckpointView
from .engine_registry import DEFAULT_ENGINE, ENGINES
from .full_size import LISTING_NAME, read_listing
from .report import BuildDevice, EngineCheckReport
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
    engine: str = DEFAULT_ENGINE,
    *,
    device: str = "auto",
    moe_runner_backend: str | None = None,
    options: Mapping[str, Any] | None = None,
    listing: str | Path | None = None,
    report_dir: str | Path | None = None,
) -> EngineCheckReport:
    """Run `engine`'s model building and weight loading over `checkpoint` in a child process; save and return the report.

    :param checkpoint: a converted (and possibly calibrated) checkpoint folder, or with `listing` a folder
        holding only config.json / hf_quant_config.json (full_size.write_full_size_checkpoint)
    :param device: "cpu" (values: sentinel audit, value checks), "meta" (shapes only), or "auto"
    :param moe_runner_backend: shorthand for the engine option `moe_runner_backend` (SGLang's --moe-runner-backend;
        "for-scheme", its default: SGLang's pick on SM100 for what SGLang parses as W4A4, marlin for weight-only)
    :param options: the engine's options (its plugin's options model; `--engine-option KEY=VALUE`)
    :param report_dir: where engine_check_<engine>.{json,md} go (default CHECKPOINT/reports)
    :raises CheckpointError: the folder is not a converted checkpoint (exit 3)
    :raises EngineUnavailableError: the engine is not installed or does not import (exit 8)
    :raises EngineProcessError: the engine's child process ended without an answer (exit 11)
    """
    try:
        driver = ENGINES.get(engine)
        values = dict(options or {})
        if moe_runner_backend is not None:
            values["moe_runner_backend"] = moe_runner_backend
        parsed = driver.parse_options(values)
    except PluginError as e:
        raise KimiNvfp4Error(str(e)) from None
    root = Path(checkpoint).expanduser().resolve()
    reports = Path(report_dir) if report_dir is not None else root / REPORT_SUBDIR
    if listing is None and (root / INDEX_NAME).is_file():
        recover_scheme_switch(root)  # a calibrate killed between the two config writes: finish it first
    if listing is None and (root / LISTING_NAME).is_file() and not (root / INDEX_NAME).is_file():
        listing = root / LISTING_NAME  # a folder written by `check-engine --full-size`
    if listing is not None:
        view = CheckpointView.from_listing(root, read_listing(listing))
    else:
        view = CheckpointView.from_folder(root)
    _ = view.declared_scheme  # a malformed quant_algo fails here (exit 3), before an engine is imported
    require_writable_dir(reports, what="the engine check's report folder")  # before minutes of engine work
    build = resolve_device(device, view)
    with tempfile.TemporaryDirectory(prefix="kimi-nvfp4-engine-check-") as tmp:
        answer_path = Path(tmp) / "answer.json"
        request = CheckRequest(
            checkpoint=str(root), engine=driver.name, device=build, options=parsed.model_dump(mode="json"),
            listing=str(Path(listing).resolve()) if listing is not None else None, answer=str(answer_path),
        )
        request_path = Path(tmp) / "request.json"
        request_path.write_text(request.model_dump_json())
        proc = subprocess.run([sys.executable, "-m", "kimi_nvfp4.engine_check.worker", str(request_path)], check=False)
        if not answer_path.is_file():
            raise EngineProcessError(
                f"the {driver.name} check process (python -m kimi_nvfp4.engine_check.worker) ended with exit code "
                f"{proc.returncode} and wrote no answer" + (f" (killed by signal {-proc.returncode})"
                                                           if proc.returncode < 0 else "")
            )
        answer = CheckAnswer.model_validate_json(answer_path.read_text())
    if answer.error is not None:
        raise _ERROR_TYPES.get(answer.exit_code, KimiNvfp4Error)(answer.error)
    report = answer.report
    report.save(reports)
    return report
