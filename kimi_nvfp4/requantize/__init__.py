"""`kimi-nvfp4 requantize`: the routed experts re-chosen against the INT4 model's outputs with calibration
statistics (docs/requantize.md)."""

from .api import RequantizeResult, requantize_checkpoint
from .options import OUTPUT_AWARE_METHODS, RequantizeOptions, expert_stats_mode_for
from .record import REQUANTIZE_STAGE, RequantizeRecord

__all__ = ["OUTPUT_AWARE_METHODS", "REQUANTIZE_STAGE", "RequantizeOptions", "RequantizeRecord", "RequantizeResult",
           "expert_stats_mode_for", "requantize_checkpoint"]
