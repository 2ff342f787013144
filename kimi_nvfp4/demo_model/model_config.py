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

from ..numerics.constants import INT4_GROUP_SIZE, NVFP4_BLOCK_SIZE
from .specials import BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, special_id

# K2.6 values kept as they are (SPEC §1).
K2_ROUTED_SCALING_FACTOR = 2.827
K2_ROPE_THETA = 50000.0
K2_YARN = {"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096,
           "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
K2_MAX_POSITION_EMBEDDINGS = 262144
K2_RMS_NORM_EPS = 1e-5


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

    def text_config(self) -> dict[str, Any]:
        """The checkpoint's `text_config`: DeepseekV3 keys with K2.6's names and values."""
        return {
            "architectures": ["DeepseekV3ForCausalLM"],
            "model_type": "deepseek_v3",
            "attention_bias": False,
            "attention_dropout": 0.0,
            "aux_loss_alpha": 0.001,
            "ep_size": 1,
            "first_k_dense_replace": self.first_k_dense_replace,
            "hidden_act": "silu",
            "hidden_size": self.hidden_size,
            "initializer_range": self.initializer_range,
            "intermediate_size": self.intermediate_size,
            "kv_lora_rank": self.kv_lora_rank,
            "max_position_embeddings": K2_MAX_POSITION_EMBEDDINGS,
            "moe_intermediate_size": self.moe_intermediate_size,
            "moe_layer_freq": 1,
            "n_group": 1,
            "n_routed_experts": self.n_routed_experts,
            "n_shared_experts": self.n_shared_experts,
            "norm_topk_prob": True,
            "num_attention_heads": self.num_attention_heads,
            "num_experts_per_tok": self.num_experts_per_tok,
            "num_hidden_layers": self.num_hidden_layers,
            "num_key_value_heads": self.num_attention_heads,
            "num_nextn_predict_layers": 0,
            "pretraining_tp": 1,
            "q_lora_rank": self.q_lora_rank,
            "qk_nope_head_dim": self.qk_nope_head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "rms_norm_eps": K2_RMS_NORM_EPS,
            "rope_scaling": dict(K2_YARN),
            "rope_theta": K2_ROPE_THETA,
            "routed_scaling_factor": K2_ROUTED_SCALING_FACTOR,
            "scoring_func": "sigmoid",
            "seq_aux": True,
            "tie_word_embeddings": False,
            "topk_group": 1,
            "topk_method": "noaux_tc",
            "torch_dtype": "bfloat16",
            "use_cache": True,
            "v_head_dim": self.v_head_dim,
            "vocab_size": self.vocab_size,
            **self.token_ids(),
        }

    def transformers_config(self):
        """`DeepseekV3Config` for training (transformers 5.x names: rope_parameters)."""
        from transformers import DeepseekV3Config

        tc = self.text_config()
        rope = {k: v for k, v in K2_YARN.items() if k != "type"}
        rope.update(rope_type="yarn", rope_theta=K2_ROPE_THETA)
        keep = ("hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "n_shared_experts", "n_routed_experts",
                "routed_scaling_factor", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "v_head_dim",
                "qk_nope_head_dim", "n_group", "topk_group", "num_experts_per_tok", "first_k_dense_replace",
                "norm_topk_prob", "hidden_act", "max_position_embeddings", "initializer_range", "rms_norm_eps",
                "tie_word_embeddings", "attention_bias", "vocab_size", "bos_token_id", "eos_token_id",
                "pad_token_id")
        return DeepseekV3Config(**{k: tc[k] for k in keep}, rope_parameters=rope, rope_interleave=True,
                                num_mtp_layers=0)
