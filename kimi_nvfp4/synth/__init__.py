"""Synthetic Kimi K2 INT4 checkpoints in the real layouts (for tests and benchmarks)."""

from .checkpoint import (
    create_synthetic_checkpoint,
    make_tiny_k2,
    plan_synthetic_checkpoint,
    shard_file_name,
)
from .configs import KIMI_VOCAB_SIZE, PRESETS
from .writing import SYNTH_DEVICES

__all__ = [
    "KIMI_VOCAB_SIZE", "PRESETS", "SYNTH_DEVICES", "create_synthetic_checkpoint", "make_tiny_k2",
    "plan_synthetic_checkpoint", "shard_file_name",
]
