"""The engine check's child process: `python -m kimi_nvfp4.engine_check.worker REQUEST.json`.

An engine run changes process-wide state that cannot be undone (torch.distributed initialised,
sys.modules holding the engine and possibly the torchvision stand-in, global config published), so
`check_engine` runs each engine in a fresh interpreter. The request and the answer are JSON files;
a user-facing error travels back with its exit code.
"""

from __future__ import annotations

import sys
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from ..errors import KimiNvfp4Error
from .checkpoint_view import CheckpointView
from .full_size import read_listing
from .report import BuildDevice, Engine, EngineCheckReport
from .sglang_session import MOE_BACKEND_FOR_SCHEME


class CheckRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    checkpoint: str
    engine: Engine
    device: BuildDevice
    moe_runner_backend: str = MOE_BACKEND_FOR_SCHEME
    listing: str | None = None  # a listing JSON (full_size.py) instead of shard headers
    answer: str  # where the worker writes its CheckAnswer


class CheckAnswer(BaseModel):
    model_config = ConfigDict(extra="forbid")

    report: EngineCheckReport | None = None
    error: str | None = None
    exit_code: int = 0


def run_request(request: CheckRequest) -> EngineCheckReport:
    if request.listing is not None:
        view = CheckpointView.from_listing(request.checkpoint, read_listing(request.listing))
    else:
        view = CheckpointView.from_folder(request.checkpoint)
    if request.engine is Engine.SGLANG:
        from .sglang_driver import run_sglang_check
        from ..checkpoint.modelopt_config import ActivationScheme
        from .sglang_session import SglangSettings

        settings = SglangSettings.for_checkpoint(
            request.moe_runner_backend,
            weight_only=view.declared_scheme is ActivationScheme.W4A16,
            kv_cache_fp8=view.kv_cache_quant_algo == "FP8",
        )
        return run_sglang_check(view, request.device, settings)
    from .vllm_driver import run_vllm_check

    return run_vllm_check(view, request.device)


def main(argv: list[str]) -> int:
    request = CheckRequest.model_validate_json(Path(argv[0]).read_text())
    try:
        answer = CheckAnswer(report=run_request(request))
    except KimiNvfp4Error as e:
        answer = CheckAnswer(error=str(e), exit_code=e.exit_code)
    Path(request.answer).write_text(answer.model_dump_json())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
