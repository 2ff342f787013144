"""The Kimi K2 / DeepSeek-V3 text-model hyper-parameters, read from a checkpoint's config.json.

One frozen dataclass that every stage (convert's shape checks, the reference model, synth) shares,
so a dimension is never re-derived from a literal.
"""

from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any

from ..errors import CheckpointError, UnsupportedCheckpointError


def _has_type(value: Any, annotation: str) -> bool:
    """Whether a config.json value fits a field annotation (the strings `from __future__ import annotations`
    leaves: `int`, `float`, `bool`, `str`, `dict[...]`, each optionally `| None`). JSON has no int/bool split in
    Python's sense, so `true` is not an int and a float field takes an integer."""
    for option in (part.strip() for part in annotation.split("|")):
        if option == "None" and value is None:
            return True
        if option == "int" and isinstance(value, int) and not isinstance(value, bool):
            return True
        if option == "float" and isinstance(value, (int, float)) and not isinstance(value, bool):
            return True
        if option == "bool" and isinstance(value, bool):
            return True
        if option == "str" and isinstance(value, str):
            return True
        if option.startswith("dict") and isinstance(value, dict):
            return True
    return False


@dataclass(frozen=True)
class K2Config:
    hidden_size: int
    num_hidden_layers: int
    vocab_size: int
    intermediate_size: int  # dense MLP width (layers < first_k_dense_replace)
    moe_intermediate_size: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    first_k_dense_replace: int
    num_attention_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None  # None: a plain q_proj instead of q_a/q_b
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    scoring_func: str = "sigmoid"
    topk_method: str = "noaux_tc"
    moe_layer_freq: int = 1
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False, compare=False)
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def is_moe_layer(self, layer: int) -> bool:
        return (
            self.n_routed_experts > 0
            and layer >= self.first_k_dense_replace
            and layer % self.moe_layer_freq == 0
        )

    @property
    def moe_layers(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if self.is_moe_layer(i)]

    @classmethod
    def from_dict(cls, text_config: dict[str, Any]) -> "K2Config":
        """Build from a `text_config` (K2.5/K2.6) or a plain DeepseekV3 config dict."""
        known = {f.name for f in fields(cls)}
        required = [
            f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING
        ]
        if not isinstance(text_config, dict):
            raise CheckpointError(f"the text config is a JSON {type(text_config).__name__}, expected an object",
                                  file="config.json")
        kwargs = {k: v for k, v in text_config.items() if k in known}
        for f in fields(cls):
            if f.name in kwargs and not _has_type(kwargs[f.name], str(f.type)):
                raise CheckpointError(
                    f"{f.name} is {kwargs[f.name]!r} ({type(kwargs[f.name]).__name__}); expected {f.type}",
                    file="config.json",
                )
        missing = [k for k in required if k not in kwargs]
        if missing:
            raise UnsupportedCheckpointError(
                f"config.json text config lacks required DeepseekV3 keys {missing}", file="config.json"
            )
        if kwargs.get("scoring_func", "sigmoid") != "sigmoid":
            raise UnsupportedCheckpointError(
                f"scoring_func {kwargs['scoring_func']!r} is not supported (Kimi K2 uses 'sigmoid')",
                file="config.json",
            )
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
