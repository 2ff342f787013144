"""calibrate: static activation scales (`input_scale`) for a converted NVFP4 checkpoint (issue #5)."""

from .api import calibrate_checkpoint
from .options import CalibrateOptions
from .policy import DEFAULT_EXPERT_POLICY, DEFAULT_MIN_EXPERT_TOKENS, ExpertPolicy
from .report import CalibrationReport
from .shard import INPUT_SCALES_SHARD

__all__ = [
    "CalibrateOptions",
    "CalibrationReport",
    "DEFAULT_EXPERT_POLICY",
    "DEFAULT_MIN_EXPERT_TOKENS",
    "ExpertPolicy",
    "INPUT_SCALES_SHARD",
    "calibrate_checkpoint",
]
