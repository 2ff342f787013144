"""transformers DeepseekV3 parameters -> Kimi K2.6 checkpoint tensors (names, dtypes, INT4 experts).

transformers 5.x fuses each MoE layer's experts into `mlp.experts.gate_up_proj [E, 2I, H]` (gate
rows first: its forward does `gate, up = linear(x, gate_up_proj[e]).chunk(2)`) and
`mlp.experts.down_proj [E, H, I]` (transformers/models/deepseek_v3/modeling_deepseek_v3.py,
`DeepseekV3Experts`). K2.6 stores one module per expert and projection, INT4 pack-quantized:
`language_model.model.layers.N.mlp.experts.E.{gate,up,down}_proj.{weight_packed,weight_scale,weight_shape}`.
Everything else is BF16 under the `language_model.` prefix, except the router's
`e_score_correction_bias`, which K2.6 keeps in float32 (docs/formats.md §1).
"""

from __future__ import annotations

from typing import Iterator, Mapping

import torch

from ..checkpoint_builder.int4 import quantize_int4_packed

TEXT_PREFIX = "language_model."
BF16 = torch.bfloat16
ROUTER_BIAS_SUFFIX = "mlp.gate.e_score_correction_bias"
FUSED_GATE_UP = "mlp.experts.gate_up_proj"
FUSED_DOWN = "mlp.experts.down_proj"


def _split_fused_experts(
    layer_prefix: str, gate_up: torch.Tensor, down: torch.Tensor
) -> Iterator[tuple[str, torch.Tensor]]:
    n_experts, two_i, _ = gate_up.shape
    inter = two_i // 2
    for e in range(n_experts):
        base = f"{layer_prefix}mlp.experts.{e}."
        yield base + "gate_proj", gate_up[e, :inter]
        yield base + "up_proj", gate_up[e, inter:]
        yield base + "down_proj", down[e]


def k2_text_tensors(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """K2.6-named tensors of the text model, routed experts INT4-packed, the rest BF16 / fp32 bias."""
    out: dict[str, torch.Tensor] = {}
    fused: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in state_dict.items():
        t = tensor.detach().to("cpu")
        if name.endswith(FUSED_GATE_UP) or name.endswith(FUSED_DOWN):
            layer_prefix = name[: name.index("mlp.experts.")]
            fused.setdefault(layer_prefix, {})[name.rsplit(".", 1)[1]] = t
        elif name.endswith(ROUTER_BIAS_SUFFIX):
            out[TEXT_PREFIX + name] = t.to(torch.float32).contiguous()
        elif name.endswith("rotary_emb.inv_freq") or name.endswith("rotary_emb.original_inv_freq"):
            continue  # derived from the config, never stored in K2 checkpoints
        else:
            out[TEXT_PREFIX + name] = t.to(BF16).contiguous()
    for layer_prefix, parts in fused.items():
        if set(parts) != {"gate_up_proj", "down_proj"}:
            raise ValueError(f"{layer_prefix}mlp.experts: expected gate_up_proj and down_proj, got {sorted(parts)}")
        for module, weight in _split_fused_experts(layer_prefix, parts["gate_up_proj"], parts["down_proj"]):
            out.update(quantize_int4_packed(weight).tensors(TEXT_PREFIX + module))
    return out
