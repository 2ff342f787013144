"""vLLM 0.33: its config parsing, name mapping, expert mapping and exclusion rules only. Its CUDA wheel cannot
build the model on a CPU-only torch, so no weight loader runs: tensor-level faults (a renamed, missing or
transposed tensor, KV scales under a name no loader maps) are NOT measured (vllm_driver.py)."""

from __future__ import annotations

from ..engine_registry import EngineDriver
from ..report import CheckCoverage

PLUGIN = EngineDriver(
    "vllm",
    "vLLM's config parsing, name mapping and exclusion rules; no weight loader runs (a rules check)",
    distribution="vllm",
    coverage=CheckCoverage.RULES,
    runner="kimi_nvfp4.engine_check.vllm_driver:run_vllm_check",
)
