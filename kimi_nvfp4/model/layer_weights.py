"""One decoder layer's weights, as loaded from a checkpoint (see weights.py for the loaders)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from .linear import Linear


@dataclass
class AttentionWeights:
    """MLA: `q_a_proj -> q_a_layernorm -> q_b_proj` (or a plain `q_proj` when q_lora_rank is None),
    `kv_a_proj_with_mqa -> kv_a_layernorm (latent part) -> kv_b_proj`, `o_proj`."""

    kv_a_proj_with_mqa: Linear
    kv_a_layernorm: torch.Tensor
    kv_b_proj: Linear
    o_proj: Linear
    q_proj: Linear | None = None
    q_a_proj: Linear | None = None
    q_a_layernorm: torch.Tensor | None = None
    q_b_proj: Linear | None = None

    def linears(self) -> Iterator[Linear]:
        for lin in (self.q_proj, self.q_a_proj, self.q_b_proj, self.kv_a_proj_with_mqa, self.kv_b_proj, self.o_proj):
            if lin is not None:
                yield lin


@dataclass
class MLPWeights:
    """SwiGLU MLP: `down(silu(gate(x)) * up(x))` -- the dense layer-0 MLP, a shared expert, a routed expert."""

    gate_proj: Linear
    up_proj: Linear
    down_proj: Linear

    def linears(self) -> Iterator[Linear]:
        yield from (self.gate_proj, self.up_proj, self.down_proj)


@dataclass
class MoEWeights:
    router_weight: torch.Tensor  # float32 [E, hidden] (`mlp.gate.weight`)
    e_score_correction_bias: torch.Tensor | None  # float32 [E]; selection only (noaux_tc)
    experts: list[MLPWeights]
    shared_experts: MLPWeights | None

    def linears(self) -> Iterator[Linear]:
        for e in self.experts:
            yield from e.linears()
        if self.shared_experts is not None:
            yield from self.shared_experts.linears()


@dataclass
class LayerWeights:
    index: int
    input_layernorm: torch.Tensor
    post_attention_layernorm: torch.Tensor
    self_attn: AttentionWeights
    mlp: MLPWeights | MoEWeights

    @property
    def is_moe(self) -> bool:
        return isinstance(self.mlp, MoEWeights)

    def linears(self) -> Iterator[Linear]:
        yield from self.self_attn.linears()
        yield from self.mlp.linears()

    def materialize(self) -> None:
        """Dequantize every linear once and keep it (small models only)."""
        for lin in self.linears():
            lin.materialize()
