"""pipeline: convert -> calibrate -> validate -> serve-check -> publish, resumable, with one summary."""

from .config import PipelineConfig, load_pipeline_config, pipeline_config_from_dict
from .demo import run_demo
from .runner import run_pipeline, run_stages
from .stage import Stage, StageContext, StageOutcome
from .summary import PipelineSummary, StageResult, StageStatus

__all__ = [
    "PipelineConfig",
    "PipelineSummary",
    "Stage",
    "StageContext",
    "StageOutcome",
    "StageResult",
    "StageStatus",
    "load_pipeline_config",
    "pipeline_config_from_dict",
    "run_demo",
    "run_pipeline",
    "run_stages",
]
