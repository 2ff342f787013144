"""The tiny K2's hyper-parameters: Kimi K2.6's text architecture at toy size.

One dataclass is the source of both the training model's transformers config and the
`text_config` written to the checkpoint, so the two can never disagree. Everything that is a
*kind* of choice in K2.6 is kept (MLA with a q LoRA, sigmoid `noaux_tc` routing with a correction
bias, `n_group 1`, normalised top-k times `routed_scaling_factor 2.827`, one shared expert, a dense
layer 0, yarn rope with K2's factor/theta, rms eps 1e-5, no MTP layer); only sizes shrink. Every
routed-expert dimension is a multiple of the INT4 group (32) and of the NVFP4 block (16).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from ..checkpoint_builder.config import ROPE_THETA, k2_text_config, yarn_rope_scaling
from ..numerics.constants import INT4_GROUP_SIZE, NVFP4_BLOCK_SIZE
from .specials import BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, special_id

# K2.6's context (docs/formats.md §1), kept so the yarn rope parameters are K2.6's own.
K2_MAX_POSITION_EMBEDDINGS = 262144


@dataclass(frozen=True)
class TinyK2Spec:
    vocab_size: int = 4096
    hidden_size: int = 256
    num_hidden_layers: int = 4
    first_k_dense_replace: int = 1
    intermediate_size: int = 384  # layer-0 dense MLP
    moe_intermediate_size: int = 96
    n_routed_experts: int = 16
    num_experts_per_tok: int = 2
    n_shared_experts: int = 1
    num_attention_heads: int = 4
    q_lora_rank: int = 96
    kv_lora_rank: int = 64
    qk_nope_head_dim: int = 32
    qk_rope_head_dim: int = 16
    v_head_dim: int = 32
    initializer_range: float = 0.02

    def __post_init__(self) -> None:
        for name in ("hidden_size", "moe_intermediate_size"):
            value = getattr(self, name)
            if value % INT4_GROUP_SIZE or value % NVFP4_BLOCK_SIZE:
                raise ValueError(f"{name}={value} must be a multiple of {INT4_GROUP_SIZE} (routed experts are INT4)")
        if self.num_hidden_layers - self.first_k_dense_replace < 1:
            raise ValueError("the tiny K2 needs at least one MoE layer")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TinyK2Spec":
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def token_ids(self) -> dict[str, int]:
        return {
            "bos_token_id": special_id(BOS_TOKEN, self.vocab_size),
            "eos_token_id": special_id(EOS_TOKEN, self.vocab_size),
            "pad_token_id": special_id(PAD_TOKEN, self.vocab_size),
        }

    def text_config(self, quantization_config: dict[str, Any] | None = None) -> dict[str, Any]:
        """The checkpoint's `text_config`: DeepseekV3 keys with K2.6's names and values, built by the checkpoint
        builder (`quantization_config`: the INT4 block the exported checkpoint carries; None for training)."""
        dims = {name: getattr(self, name) for name in (
            "first_k_dense_replace", "hidden_size", "initializer_range", "intermediate_size", "kv_lora_rank",
            "moe_intermediate_size", "n_routed_experts", "n_shared_experts", "num_attention_heads",
            "num_experts_per_tok", "num_hidden_layers", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
            "v_head_dim", "vocab_size")}
        dims.update(max_position_embeddings=K2_MAX_POSITION_EMBEDDINGS, num_key_value_heads=self.num_attention_heads)
        return k2_text_config(dims, token_ids=self.token_ids(), quantization_config=quantization_config)

    def transformers_config(self):
        """`DeepseekV3Config` for training (transformers 5.x names: rope_parameters)."""
        from transformers import DeepseekV3Config

        tc = self.text_config()
        rope = {k: v for k, v in yarn_rope_scaling(K2_MAX_POSITION_EMBEDDINGS).items() if k != "type"}
        rope.update(rope_type="yarn", rope_theta=ROPE_THETA)
        keep = ("hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "n_shared_experts", "n_routed_experts",
                "routed_scaling_factor", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "v_head_dim",
                "qk_nope_head_dim", "n_group", "topk_group", "num_experts_per_tok", "first_k_dense_replace",
                "norm_topk_prob", "hidden_act", "max_position_embeddings", "initializer_range", "rms_norm_eps",
                "tie_word_embeddings", "attention_bias", "vocab_size", "bos_token_id", "eos_token_id",
                "pad_token_id")
        return DeepseekV3Config(**{k: tc[k] for k in keep}, rope_parameters=rope, rope_interleave=True,
                                num_mtp_layers=0)
