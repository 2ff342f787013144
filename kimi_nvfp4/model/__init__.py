"""Layer-streamed reference Kimi K2 / DeepSeek-V3 model with NVFP4 emulation (docs/model.md).

- `open_weights(path)` -> a `WeightSource` (`Int4SourceWeights` or `NVFP4Weights`) handing out one layer at a time;
- `LayerStreamRunner` runs many sequences layer by layer, reporting linears to an `Observer`;
- `K2Model` keeps a small model resident for cached forward passes and `generate`.
"""

from .generate import GenerationResult, K2Model, KVCache, generate
from .linear import ActivationMode
from .nvfp4_linears import InputScaleReduction
from .observer import NullObserver, Observer
from .runner import HiddenStates, LayerStreamRunner
from .weights import (
    Int4SourceWeights,
    NVFP4Weights,
    WeightSource,
    detect_checkpoint_kind,
    open_weights,
)

__all__ = [
    "ActivationMode",
    "GenerationResult",
    "HiddenStates",
    "InputScaleReduction",
    "Int4SourceWeights",
    "K2Model",
    "KVCache",
    "LayerStreamRunner",
    "NVFP4Weights",
    "NullObserver",
    "Observer",
    "WeightSource",
    "detect_checkpoint_kind",
    "generate",
    "open_weights",
]
