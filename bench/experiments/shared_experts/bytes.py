"""Arithmetic, not a measurement: the bytes `convert --shared-experts nvfp4` saves at Kimi K2.6's size.

From the real K2.6 dimensions (synth's `k2.6` preset, Kimi's 163840-token vocabulary): the shared experts' bytes
in the checkpoint with BF16 and with NVFP4 shared experts, and the weight bytes one decode step reads per token at
batch 1 (each weight the token touches, read once: top-k routed experts in NVFP4, the shared expert, MLA
projections in BF16, the dense layers' MLP, the routers and lm_head; embedding rows and KV cache left out).
Writes JSON for docs/benchmarks.md §11:

    python -m bench.experiments.shared_experts.bytes --json bench/results/shared_expert_bytes_k26.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kimi_nvfp4.synth.configs import KIMI_VOCAB_SIZE, TEXT_PRESETS

from bench.harness.provenance import provenance

BF16_BYTES = 2
NVFP4_BLOCK = 16
# NVFP4: a 4-bit code per weight plus one E4M3 byte per block of 16 (docs/formats.md §2).
NVFP4_BYTES = 0.5 + 1 / NVFP4_BLOCK
F32_BYTES = 4
# Per NVFP4 MLP (gate, up, down): one f32 weight_scale_2 and one f32 input_scale each.
NVFP4_SCALARS_PER_MLP = 3 * 2
MLP_MATRICES = 3  # gate_proj, up_proj, down_proj
REFERENCE_CHECKPOINT_BYTES = 595e9  # the published K2.6 INT4 checkpoint's size, for scale


def k26_bytes(cfg: dict, vocab_size: int) -> dict:
    h, layers, dense = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["first_k_dense_replace"]
    moe_layers = layers - dense
    expert = MLP_MATRICES * h * cfg["moe_intermediate_size"]  # weights of one routed or shared expert
    shared = expert * cfg["n_shared_experts"]
    heads, qk = cfg["num_attention_heads"], cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
    mla = (
        h * cfg["q_lora_rank"] + cfg["q_lora_rank"] * heads * qk
        + h * (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"])
        + cfg["kv_lora_rank"] * heads * (cfg["qk_nope_head_dim"] + cfg["v_head_dim"])
        + heads * cfg["v_head_dim"] * h
    )
    shared_bf16 = moe_layers * shared * BF16_BYTES
    shared_nvfp4 = moe_layers * (shared * NVFP4_BYTES + NVFP4_SCALARS_PER_MLP * F32_BYTES)
    common = {
        "routed_experts_nvfp4": moe_layers * cfg["num_experts_per_tok"] * expert * NVFP4_BYTES,
        "mla_projections_bf16": layers * mla * BF16_BYTES,
        "dense_mlp_bf16": dense * MLP_MATRICES * h * cfg["intermediate_size"] * BF16_BYTES,
        "routers_bf16": moe_layers * cfg["n_routed_experts"] * h * BF16_BYTES,
        "lm_head_bf16": vocab_size * h * BF16_BYTES,
    }
    per_token_common = sum(common.values())
    return {
        "device": "none (arithmetic from the K2.6 config)",
        "kind": "arithmetic, not a measurement",
        "config": {**cfg, "vocab_size": vocab_size},
        "shared_expert_weights_per_layer": shared,
        "moe_layers": moe_layers,
        "shared_experts_bytes": {"bf16": shared_bf16, "nvfp4": shared_nvfp4},
        "reference_checkpoint_bytes": REFERENCE_CHECKPOINT_BYTES,
        "per_token_read_bytes_parts": common,
        "per_token_read_bytes": {"bf16": per_token_common + shared_bf16, "nvfp4": per_token_common + shared_nvfp4},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, default=Path("shared_expert_bytes.json"))
    args = ap.parse_args()
    record = {**k26_bytes(dict(TEXT_PRESETS["k2.6"]), KIMI_VOCAB_SIZE), **provenance()}
    args.json.write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record["shared_experts_bytes"]), json.dumps(record["per_token_read_bytes"]))


if __name__ == "__main__":
    main()
