"""SGLang 0.5.23: its model built on the CPU (or meta device) and its own `load_weights` run over the
checkpoint, with a sentinel audit of every parameter and its post-load processing (sglang_driver.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

from ..engine_registry import EngineDriver
from ..report import CheckCoverage
from ..sglang_session import MOE_BACKEND_FOR_SCHEME


class SglangOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    # SGLang's --moe-runner-backend; "for-scheme": what SGLang picks on SM100 (flashinfer_trtllm) for a checkpoint
    # SGLang parses as W4A4, marlin for one it parses as weight-only
    moe_runner_backend: Literal["for-scheme", "auto", "flashinfer_trtllm", "flashinfer_cutlass", "marlin"] = (
        MOE_BACKEND_FOR_SCHEME
    )


PLUGIN = EngineDriver(
    "sglang",
    "SGLang's own model build, load_weights and post-load processing (a loader check)",
    options_model=SglangOptions,
    distribution="sglang",
    coverage=CheckCoverage.LOADER,
    runner="kimi_nvfp4.engine_check.sglang_driver:run_sglang_driver",
)
