"""Rotary position embedding of the K2 / DeepSeek-V3 MLA rope dims, with YaRN scaling.

What the checkpoint's numbers mean here (all from config.json):
- rope is applied to the last `qk_rope_head_dim` dims of each query head and to the single shared
  `k_pe` head; pairs are INTERLEAVED `(x0, x1), (x2, x3), ...`, pair j rotated by `inv_freq[j]`
  (DeepSeek's reference `apply_rotary_emb` uses `view_as_complex`; SGLang builds the rope with
  `is_neox_style=False`; transformers' `apply_rotary_pos_emb_interleave`, chosen by
  `rope_interleave=True`, the DeepseekV3Config default).
- YaRN (`rope_scaling.type == "yarn"`): inverse frequencies blend interpolation (`/factor`) and
  extrapolation with a linear ramp between the correction dims of `beta_fast`/`beta_slow`
  (floored/ceiled: transformers `_compute_yarn_parameters`, `truncate=True`); cos/sin are multiplied
  by `attention_factor = mscale(factor, mscale) / mscale(factor, mscale_all_dim)` (1.0 for Kimi K2);
  the softmax scale `qk_head_dim**-0.5` is multiplied by `mscale(factor, mscale_all_dim)**2`
  (transformers `yarn_apply_mscale`; SGLang `DeepseekV2AttentionMLA.__init__` does the same).

Like transformers' interleave path, the rotated output is laid out half-split (`[evens', odds']`);
queries and keys are permuted alike, so every q.k dot product equals the interleaved one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..checkpoint.k2_config import K2Config
from ..errors import UnsupportedCheckpointError

# YaRN defaults (the paper's; transformers uses the same when a key is absent).
YARN_DEFAULT_BETA_FAST = 32.0
YARN_DEFAULT_BETA_SLOW = 1.0
# transformers' linear_ramp_factor: avoid a zero-width ramp.
_RAMP_MIN_WIDTH = 0.001


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature correction `0.1 * mscale * ln(factor) + 1` (1 when factor <= 1)."""
    if factor <= 1:
        return 1.0
    return 0.1 * mscale * math.log(factor) + 1.0


def _rope_type(rope_scaling: dict | None) -> str:
    if not rope_scaling:
        return "default"
    return str(rope_scaling.get("rope_type", rope_scaling.get("type", "default")))


def _yarn_inv_freq(cfg: K2Config, rs: dict, base: float, dim: int) -> tuple[torch.Tensor, float]:
    factor = rs.get("factor")
    original_max = rs.get("original_max_position_embeddings", cfg.max_position_embeddings)
    if factor is None:
        factor = cfg.max_position_embeddings / original_max
    factor = float(factor)
    beta_fast = rs.get("beta_fast") or YARN_DEFAULT_BETA_FAST
    beta_slow = rs.get("beta_slow") or YARN_DEFAULT_BETA_SLOW
    mscale, mscale_all_dim = rs.get("mscale"), rs.get("mscale_all_dim")
    attention_factor = rs.get("attention_factor")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_mscale(factor)

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original_max / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rs.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += _RAMP_MIN_WIDTH
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extrapolation_weight = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_weight) + extrapolation * extrapolation_weight
    return inv_freq, float(attention_factor)


@dataclass(frozen=True)
class RotaryEmbedding:
    """Rope tables for the MLA rope dims, plus the softmax scale the rope scaling implies."""

    inv_freq: torch.Tensor  # float32 [qk_rope_head_dim / 2]
    attention_factor: float  # multiplies cos and sin
    softmax_scale: float

    @classmethod
    def from_config(cls, cfg: K2Config) -> RotaryEmbedding:
        dim, base = cfg.qk_rope_head_dim, float(cfg.rope_theta)
        rs = cfg.rope_scaling or {}
        kind = _rope_type(rs)
        softmax_scale = cfg.qk_head_dim**-0.5
        if kind == "default":
            inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
            return cls(inv_freq, 1.0, softmax_scale)
        if kind != "yarn":
            raise UnsupportedCheckpointError(
                f"rope_scaling type {kind!r} is not supported (Kimi K2 uses 'yarn')", file="config.json"
            )
        inv_freq, attention_factor = _yarn_inv_freq(cfg, rs, base, dim)
        mscale_all_dim = rs.get("mscale_all_dim", 0)
        if mscale_all_dim:
            softmax_scale *= yarn_mscale(float(rs["factor"]), mscale_all_dim) ** 2
        return cls(inv_freq, attention_factor, softmax_scale)

    def cos_sin(self, positions: torch.Tensor, device: torch.device | str, dtype: torch.dtype):
        """cos, sin `[T, dim/2]` for absolute positions (angles computed in float32 like transformers)."""
        freqs = positions.to(device=device, dtype=torch.float32)[:, None] * self.inv_freq.to(device)[None, :]
        cos = freqs.cos() * self.attention_factor
        sin = freqs.sin() * self.attention_factor
        return cos.to(dtype), sin.to(dtype)


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs of `x [T, heads, dim]`; output half-split `[even', odd']` (see module doc)."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.cat([even * cos - odd * sin, odd * cos + even * sin], dim=-1)
