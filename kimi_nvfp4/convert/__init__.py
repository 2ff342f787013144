"""The convert stage: INT4 Kimi K2.x checkpoints to NVFP4 in NVIDIA Model Optimizer's HF format."""

from .api import ConversionSummary, convert_checkpoint
from .options import ConvertOptions
from .plan import ConversionPlan, plan_conversion

__all__ = ["ConversionPlan", "ConversionSummary", "ConvertOptions", "convert_checkpoint", "plan_conversion"]
