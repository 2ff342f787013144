"""One K2 decoder layer, split where the layer-streamed runner needs it split.

`h = x + attn(input_layernorm(x))` runs per sequence (attention is causal within a sequence);
`out = h + mlp(post_attention_layernorm(h))` is token-wise, so it runs on chunks of tokens drawn from
all sequences at once (better expert batches). Both halves are what transformers' DeepseekV3DecoderLayer
and SGLang's DeepseekV2DecoderLayer compute.
"""

from __future__ import annotations

import torch

from ..checkpoint.k2_config import K2Config
from .attention import LatentKV, mla_attention, rms_norm
from .layer_weights import LayerWeights, MoEWeights
from .moe import moe, swiglu_mlp
from .observer import Observer
from .rope import RotaryEmbedding


def attention_block(
    cfg: K2Config,
    rope: RotaryEmbedding,
    w: LayerWeights,
    x: torch.Tensor,
    *,
    past: LatentKV | None = None,
    observer: Observer | None = None,
) -> tuple[torch.Tensor, LatentKV]:
    normed = rms_norm(x, w.input_layernorm, cfg.rms_norm_eps)
    o, cache = mla_attention(
        cfg, rope, w.self_attn, normed, layer=w.index, past=past, observer=observer
    )
    return x + o, cache


def mlp_block(
    cfg: K2Config, w: LayerWeights, h: torch.Tensor, *, observer: Observer | None = None, need_output: bool = True
) -> torch.Tensor | None:
    """`h + mlp(norm(h))`; with `need_output=False` only the observer's statistics (returns None)."""
    normed = rms_norm(h, w.post_attention_layernorm, cfg.rms_norm_eps)
    if isinstance(w.mlp, MoEWeights):
        y = moe(cfg, w.mlp, normed, layer=w.index, observer=observer, need_output=need_output)
    else:
        y = swiglu_mlp(w.mlp, normed, layer=w.index, observer=observer, need_output=need_output)
    return h + y if need_output else None
