"""The child process of `check_engine`: one engine check per interpreter.

SGLang and vLLM change process-wide state when imported and set up (torch.distributed, their
published config, patched transformers classes, sys.modules), so `check_engine` runs each engine in a
fresh interpreter. The request and the answer are JSON files; a user-facing error travels back with
its exit code. Which engine runs is a lookup in the engine registry (engine_registry.ENGINES), never a
branch on its name.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from ..errors import KimiNvfp4Error
from .checkpoint_view import CheckpointView
from .engine_registry import ENGINES
from .full_size import read_listing
from .report import BuildDevice, EngineCheckReport


class CheckRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    checkpoint: str
    engine: str  # a name in ENGINES
    device: BuildDevice
    options: dict[str, Any] = Field(default_factory=dict)  # the engine's options (its plugin's options model)
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
    driver = ENGINES.get(request.engine)
    return driver.run(view, request.device, driver.parse_options(request.options))


def main(argv: list[str]) -> int:
    request = CheckRequest.model_validate_json(Path(argv[0]).read_text())
    try:
        answer = CheckAnswer(report=run_request(request))
    except KimiNvfp4Error as e:
        answer = CheckAnswer(error=str(e), exit_code=e.exit_code)
    partial = Path(request.answer + ".partial")
    partial.write_text(answer.model_dump_json())
    partial.replace(request.answer)  # the parent never reads half an answer
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
