"""pipeline: convert -> calibrate -> validate -> serve-check -> publish, resumable, with one summary.

The public names are imported lazily: `kimi-nvfp4 run --help` loads only the command, not every stage
(building `PipelineConfig` imports each stage's options model, and with it torch).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "PipelineConfig": "config",
    "load_pipeline_config": "config",
    "pipeline_config_from_dict": "config",
    "run_demo": "demo",
    "build_stages": "runner",
    "run_pipeline": "runner",
    "run_stages": "runner",
    "Stage": "..stage_kit.pipeline_stage",
    "StageContext": "..stage_kit.pipeline_stage",
    "StageOutcome": "..stage_kit.pipeline_stage",
    "PipelineSummary": "summary",
    "StageResult": "summary",
    "StageStatus": "summary",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = _EXPORTS[name]
    return getattr(importlib.import_module(module if module.startswith(".") else f".{module}", __name__), name)
