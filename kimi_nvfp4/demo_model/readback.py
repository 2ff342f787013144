"""Load a K2-layout checkpoint (INT4 experts) back into transformers' DeepseekV3ForCausalLM.

Used to measure what the shipped checkpoint actually computes: BF16 tensors as stored, INT4
experts dequantized exactly (`kimi_nvfp4.numerics.int4.dequantize_int4`), all in float32. This is
the inverse of `k2_layout_export` and reads through the project's header-first CheckpointReader.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..checkpoint.reader import CheckpointReader
from ..errors import CheckpointError
from ..numerics.int4 import dequantize_int4


def transformers_config_from_text_config(text_config: dict[str, Any]):
    """DeepseekV3Config for a K2 `text_config` (rope_scaling + rope_theta -> rope_parameters)."""
    from transformers import DeepseekV3Config

    tc = dict(text_config)
    rope = dict(tc.pop("rope_scaling", None) or {})
    rope_type = rope.pop("type", rope.pop("rope_type", "default"))
    rope.update(rope_type=rope_type, rope_theta=float(tc.pop("rope_theta", 10000.0)))
    keep = ("hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "n_shared_experts", "n_routed_experts",
            "routed_scaling_factor", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "v_head_dim",
            "qk_nope_head_dim", "n_group", "topk_group", "num_experts_per_tok", "first_k_dense_replace",
            "norm_topk_prob", "hidden_act", "max_position_embeddings", "initializer_range", "rms_norm_eps",
            "tie_word_embeddings", "attention_bias", "vocab_size", "bos_token_id", "eos_token_id", "pad_token_id")
    return DeepseekV3Config(**{k: tc[k] for k in keep if k in tc}, rope_parameters=rope, rope_interleave=True,
                            num_mtp_layers=0)


def load_transformers_model(checkpoint: Path, device: str = "cpu"):
    """float32 DeepseekV3ForCausalLM holding exactly the checkpoint's values (experts dequantized)."""
    from transformers import DeepseekV3ForCausalLM

    reader = CheckpointReader(Path(checkpoint))
    layout = reader.layout
    cfg = layout.text
    model = DeepseekV3ForCausalLM(transformers_config_from_text_config(layout.text_config_dict))
    prefix = layout.text_prefix
    state: dict[str, torch.Tensor] = {}
    for name in model.state_dict():
        if name.endswith("rotary_emb.inv_freq") or name.endswith("rotary_emb.original_inv_freq"):
            continue
        if name.endswith("mlp.experts.gate_up_proj") or name.endswith("mlp.experts.down_proj"):
            layer = int(name.split(".")[2])
            gate_up, down = [], []
            for e in range(cfg.n_routed_experts):
                mats = {}
                for proj in ("gate_proj", "up_proj", "down_proj"):
                    module = layout.expert_module(layer, e, proj)
                    shape = reader.load(f"{module}.weight_shape").tolist()
                    mats[proj] = dequantize_int4(reader.load(f"{module}.weight_packed"),
                                                 reader.load(f"{module}.weight_scale"), int(shape[1]))
                    if list(mats[proj].shape) != shape:
                        raise CheckpointError(f"weight_shape {shape} disagrees with the packed data",
                                              tensor=f"{module}.weight_packed")
                gate_up.append(torch.cat([mats["gate_proj"], mats["up_proj"]], dim=0))
                down.append(mats["down_proj"])
            state[name] = torch.stack(gate_up if name.endswith("gate_up_proj") else down)
            continue
        src = prefix + name
        if src not in reader:
            raise CheckpointError("tensor missing from the checkpoint", tensor=src)
        state[name] = reader.load(src).to(torch.float32)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if "rotary_emb" not in m]
    if missing or unexpected:
        raise CheckpointError(f"checkpoint does not fill the model: missing {missing[:5]}, unexpected {unexpected[:5]}",
                              file=str(checkpoint))
    return model.to(device).eval()
