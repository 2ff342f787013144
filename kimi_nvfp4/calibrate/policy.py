"""Input scales from activation statistics, and what to do about experts that saw few tokens.

Per SGLang's `ModelOptNvFp4FusedMoEMethod.process_weights_after_loading`
(python/sglang/srt/layers/quantization/modelopt_quant.py): on the flashinfer MoE backends
`w13_input_scale` and `w2_input_scale` are reduced by `.max()` over ALL experts of the layer (and
over gate/up); on the cutlass backend `w13_input_scale` is reduced by max over gate/up per expert.
So gate_proj and up_proj of an expert always get the same input_scale here (they see the same
input anyway), and the layer max is what the flashinfer backends actually use.

Experts with fewer than `min_expert_tokens` routed tokens have an unreliable amax; two policies:
- `peer-max`: take the layer's max over the well-covered experts (ModelOpt's fallback; also exactly
  the value the flashinfer backends use for every expert).
- `route-all`: use the amax from a statistics-only pass where every token runs through every
  expert (llm-compressor's approach); the layer output is unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch

from ..numerics.constants import NVFP4_TENSOR_SCALE_DENOMINATOR
from ..numerics.nvfp4 import divide_exactly
from .stats import ActivationStats, StatsKey


class ExpertPolicy(str, Enum):
    PEER_MAX = "peer-max"
    ROUTE_ALL = "route-all"


# Chosen from the demo-model measurement recorded in docs/calibrate.md.
DEFAULT_EXPERT_POLICY = ExpertPolicy.PEER_MAX
# An expert needs this many routed tokens before its own amax is trusted (ModelOpt and
# llm-compressor recipes both see experts with a handful of tokens produce outlier-free, too-small amax).
DEFAULT_MIN_EXPERT_TOKENS = 32
# input_scale must be finite and > 0 (SGLang inverts it: `1 / w13_input_scale`); a linear that never
# sees a non-zero input gets the scale of amax = 1.
FALLBACK_AMAX = 1.0

EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj")
EXPERT_INPUT_GROUPS = {"gate_proj": "gate_up", "up_proj": "gate_up", "down_proj": "down"}


def input_scale_from_amax(amax: float | torch.Tensor) -> torch.Tensor:
    """ModelOpt's static activation global scale: `amax / (6 * 448)`, float32 0-d."""
    a = torch.as_tensor(amax, dtype=torch.float32).reshape(())
    if not torch.isfinite(a) or a <= 0:
        a = torch.tensor(FALLBACK_AMAX, dtype=torch.float32)
    return divide_exactly(a, NVFP4_TENSOR_SCALE_DENOMINATOR).to(torch.float32)


def expert_module(expert: int, proj: str) -> str:
    """Module name of a routed expert linear inside a layer (observer naming, no prefix)."""
    return f"mlp.experts.{expert}.{proj}"


@dataclass(frozen=True)
class ExpertAmax:
    """The amax chosen for one expert input (gate_up or down) and where it came from."""

    expert: int
    group: str  # "gate_up" | "down"
    amax: float
    source: str  # "routed" | "peer-max" | "route-all" | "fallback"
    tokens: int


def _group_amax(stats: dict[StatsKey, ActivationStats], expert: int, group: str) -> tuple[float, int] | None:
    projs = [p for p, g in EXPERT_INPUT_GROUPS.items() if g == group]
    found = [stats[(expert_module(expert, p), expert)] for p in projs if (expert_module(expert, p), expert) in stats]
    if not found:
        return None
    return max(s.amax_value for s in found), max(s.tokens for s in found)


def choose_expert_amax(
    routed: dict[StatsKey, ActivationStats],
    route_all: dict[StatsKey, ActivationStats],
    tokens_per_expert: list[int],
    *,
    policy: ExpertPolicy,
    min_expert_tokens: int,
) -> list[ExpertAmax]:
    """One amax per (expert, input group) of a MoE layer, applying the under-covered policy."""
    n_experts = len(tokens_per_expert)
    out: list[ExpertAmax] = []
    for group in ("gate_up", "down"):
        own = {e: _group_amax(routed, e, group) for e in range(n_experts)}
        covered = [
            own[e][0] for e in range(n_experts) if own[e] is not None and tokens_per_expert[e] >= min_expert_tokens
        ]
        # No expert reached the threshold: the best peer estimate is the max over everything seen.
        peer_pool = covered or [v[0] for v in own.values() if v is not None and v[1] > 0]
        peer_max = max(peer_pool) if peer_pool else None
        for e in range(n_experts):
            tokens = tokens_per_expert[e]
            if own[e] is not None and tokens >= min_expert_tokens and own[e][0] > 0:
                out.append(ExpertAmax(e, group, own[e][0], "routed", tokens))
                continue
            if policy is ExpertPolicy.ROUTE_ALL:
                full = _group_amax(route_all, e, group)
                if full is not None and full[0] > 0:
                    # Seen tokens are a subset of all tokens, so this is >= the routed amax.
                    out.append(ExpertAmax(e, group, full[0], "route-all", tokens))
                    continue
            if peer_max is not None and peer_max > 0:
                out.append(ExpertAmax(e, group, peer_max, "peer-max", tokens))
            else:
                out.append(ExpertAmax(e, group, FALLBACK_AMAX, "fallback", tokens))
    return out
