"""Which tensors a K2-layout checkpoint holds, in what order, and their synthetic contents.

`checkpoint_tensor_specs` lists every tensor (name, shape, dtype, how to fill it) in the order a
real checkpoint stores them (embeddings, then layer by layer, then norm / head / vision), so shards
cut from this list split the way Moonshot's do (an expert's gate and up can land in different
shards). Contents are deterministic per tensor name and seed, independent of sharding.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch

from ..checkpoint.k2_config import K2Config
from ..checkpoint.layout import PROJS
from ..checkpoint.writer import spec_nbytes
from ..numerics.constants import INT4_GROUP_SIZE, INT4_MAX, INT4_MIN, INT4_PER_INT32
from ..numerics.int4 import pack_int4

# Standard deviation of synthetic BF16 linear weights (typical of trained LLM projections).
LINEAR_WEIGHT_STD = 0.02
# Per-row spread (log-normal sigma) of expert weight magnitudes, so group scales vary like real ones.
EXPERT_ROW_LOG_STD = 0.3
# Realistic INT4: compressed-tensors' symmetric minmax rule (quantization/utils/helpers.py
# `calculate_qparams`: scale = absmax / (bit_range / 2) = absmax / 7.5), so a group's extreme value
# lands on +7 (clamped from 7.5) or -8, and every one of the 16 codes occurs.
INT4_ABSMAX_DIVISOR = (INT4_MAX - INT4_MIN) / 2
# Rows generated at once for huge tensors (embeddings at real size are 1.2e9 elements).
_GENERATE_ROWS = 4096


class Fill(str, Enum):
    LINEAR = "linear"  # BF16 Gaussian weight
    NORM = "norm"  # BF16 around 1.0
    BIAS = "bias"  # small values (router correction bias is float32)
    INT4_PACKED = "int4_packed"
    INT4_SCALE = "int4_scale"
    INT4_SHAPE = "int4_shape"


class CodeDistribution(str, Enum):
    REALISTIC = "realistic"  # Gaussian weights quantized with absmax/7.5 bf16 group scales
    UNIFORM = "uniform"  # every INT4 code equally likely, log-uniform scales (stress test)


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    fill: Fill
    # For INT4 triples: the [out, in] of the dequantized matrix.
    matrix_shape: tuple[int, int] | None = None

    @property
    def nbytes(self) -> int:
        return spec_nbytes(self.dtype, self.shape)


def _linear(name: str, out_f: int, in_f: int) -> TensorSpec:
    return TensorSpec(f"{name}.weight", (out_f, in_f), torch.bfloat16, Fill.LINEAR)


def _norm(name: str, n: int, bias: bool = False) -> list[TensorSpec]:
    specs = [TensorSpec(f"{name}.weight", (n,), torch.bfloat16, Fill.NORM)]
    if bias:
        specs.append(TensorSpec(f"{name}.bias", (n,), torch.bfloat16, Fill.BIAS))
    return specs


def _int4_expert(module: str, out_f: int, in_f: int) -> list[TensorSpec]:
    m = (out_f, in_f)
    return [
        TensorSpec(f"{module}.weight_packed", (out_f, in_f // INT4_PER_INT32), torch.int32, Fill.INT4_PACKED, m),
        TensorSpec(f"{module}.weight_scale", (out_f, in_f // INT4_GROUP_SIZE), torch.bfloat16, Fill.INT4_SCALE, m),
        TensorSpec(f"{module}.weight_shape", (2,), torch.int32, Fill.INT4_SHAPE, m),
    ]


def _attention(p: str, c: K2Config) -> list[TensorSpec]:
    h = c.hidden_size
    specs: list[TensorSpec] = []
    if c.q_lora_rank:
        specs += [_linear(f"{p}q_a_proj", c.q_lora_rank, h), *_norm(f"{p}q_a_layernorm", c.q_lora_rank)]
        specs.append(_linear(f"{p}q_b_proj", c.num_attention_heads * c.qk_head_dim, c.q_lora_rank))
    else:
        specs.append(_linear(f"{p}q_proj", c.num_attention_heads * c.qk_head_dim, h))
    specs += [
        _linear(f"{p}kv_a_proj_with_mqa", c.kv_lora_rank + c.qk_rope_head_dim, h),
        *_norm(f"{p}kv_a_layernorm", c.kv_lora_rank),
        _linear(f"{p}kv_b_proj", c.num_attention_heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank),
        _linear(f"{p}o_proj", h, c.num_attention_heads * c.v_head_dim),
    ]
    return specs


def _mlp(p: str, hidden: int, width: int) -> list[TensorSpec]:
    return [_linear(f"{p}gate_proj", width, hidden), _linear(f"{p}up_proj", width, hidden), _linear(f"{p}down_proj", hidden, width)]


def layer_tensor_specs(prefix: str, layer: int, c: K2Config) -> list[TensorSpec]:
    p = f"{prefix}model.layers.{layer}."
    specs = [*_norm(f"{p}input_layernorm", c.hidden_size), *_attention(f"{p}self_attn.", c)]
    specs += _norm(f"{p}post_attention_layernorm", c.hidden_size)
    if not c.is_moe_layer(layer):
        return specs + _mlp(f"{p}mlp.", c.hidden_size, c.intermediate_size)
    specs.append(_linear(f"{p}mlp.gate", c.n_routed_experts, c.hidden_size))
    specs.append(TensorSpec(f"{p}mlp.gate.e_score_correction_bias", (c.n_routed_experts,), torch.float32, Fill.BIAS))
    for e in range(c.n_routed_experts):
        for proj in PROJS:
            out_f, in_f = (
                (c.hidden_size, c.moe_intermediate_size) if proj == "down_proj" else (c.moe_intermediate_size, c.hidden_size)
            )
            specs += _int4_expert(f"{p}mlp.experts.{e}.{proj}", out_f, in_f)
    specs += _mlp(f"{p}mlp.shared_experts.", c.hidden_size, c.moe_intermediate_size * c.n_shared_experts)
    return specs


def vision_tensor_specs(vision: dict[str, Any]) -> list[TensorSpec]:
    """A MoonViT-shaped vision tower and the patch-merger projector (BF16, passed through by convert)."""
    d, inner = vision["vt_hidden_size"], vision["vt_intermediate_size"]
    patch = vision["patch_size"]
    merged = d * vision["merge_kernel_size"][0] * vision["merge_kernel_size"][1]
    specs = [
        TensorSpec("vision_tower.patch_embed.proj.weight", (d, 3, patch, patch), torch.bfloat16, Fill.LINEAR),
        TensorSpec("vision_tower.patch_embed.proj.bias", (d,), torch.bfloat16, Fill.BIAS),
        TensorSpec(
            "vision_tower.patch_embed.pos_emb.weight",
            (vision["init_pos_emb_height"], vision["init_pos_emb_width"], d),
            torch.bfloat16,
            Fill.LINEAR,
        ),
    ]
    for i in range(vision["vt_num_hidden_layers"]):
        b = f"vision_tower.encoder.blocks.{i}."
        specs += [*_norm(f"{b}norm0", d, bias=True), *_norm(f"{b}norm1", d, bias=True)]
        for name, out_f, in_f in (("wqkv", 3 * d, d), ("wo", d, d), ("mlp.fc0", inner, d), ("mlp.fc1", d, inner)):
            specs += [_linear(f"{b}{name}", out_f, in_f), TensorSpec(f"{b}{name}.bias", (out_f,), torch.bfloat16, Fill.BIAS)]
    specs += _norm("vision_tower.encoder.final_layernorm", d, bias=True)
    specs += _norm("mm_projector.pre_norm", d, bias=True)
    specs += [_linear("mm_projector.proj.0", merged, merged), TensorSpec("mm_projector.proj.0.bias", (merged,), torch.bfloat16, Fill.BIAS)]
    specs += [
        _linear("mm_projector.proj.2", vision["text_hidden_size"], merged),
        TensorSpec("mm_projector.proj.2.bias", (vision["text_hidden_size"],), torch.bfloat16, Fill.BIAS),
    ]
    return specs


def checkpoint_tensor_specs(c: K2Config, prefix: str, vision: dict[str, Any] | None) -> list[TensorSpec]:
    specs = [TensorSpec(f"{prefix}model.embed_tokens.weight", (c.vocab_size, c.hidden_size), torch.bfloat16, Fill.LINEAR)]
    for layer in range(c.num_hidden_layers):
        specs += layer_tensor_specs(prefix, layer, c)
    specs += _norm(f"{prefix}model.norm", c.hidden_size)
    specs.append(_linear(f"{prefix}lm_head", c.vocab_size, c.hidden_size))
    if vision is not None:
        specs += vision_tensor_specs(vision)
    return specs


# --- contents ------------------------------------------------------------------------------
def _generator(seed: int, key: str) -> torch.Generator:
    # Seed per tensor (or per expert matrix) so contents do not depend on shard order.
    return torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(key.encode())) % (2**63))


def _gaussian_bf16(shape: tuple[int, ...], std: float, gen: torch.Generator) -> torch.Tensor:
    out = torch.empty(shape, dtype=torch.bfloat16)
    flat = out.view(shape[0], -1) if len(shape) > 1 else out.view(1, -1)
    for start in range(0, flat.shape[0], _GENERATE_ROWS):
        rows = flat[start : start + _GENERATE_ROWS]
        rows.copy_(torch.randn(rows.shape, generator=gen) * std)
    return out


def synthetic_int4_matrix(
    module: str, out_f: int, in_f: int, seed: int, distribution: CodeDistribution
) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 codes [out, in], bf16 group scales [out, in/32]) for one expert matrix."""
    gen = _generator(seed, module)
    groups = in_f // INT4_GROUP_SIZE
    if distribution is CodeDistribution.UNIFORM:
        codes = torch.randint(INT4_MIN, INT4_MAX + 1, (out_f, in_f), generator=gen, dtype=torch.int8)
        log_scale = torch.rand(out_f, groups, generator=gen) * 6.0 - 10.0  # scales in [2^-10, 2^-4]
        return codes, torch.exp2(log_scale).to(torch.bfloat16)
    row_std = LINEAR_WEIGHT_STD * torch.exp(torch.randn(out_f, 1, generator=gen) * EXPERT_ROW_LOG_STD)
    w = (torch.randn(out_f, in_f, generator=gen) * row_std).view(out_f, groups, INT4_GROUP_SIZE)
    scale = (w.abs().amax(dim=-1) / INT4_ABSMAX_DIVISOR).to(torch.bfloat16)
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    codes = torch.round(w / scale.float().unsqueeze(-1)).clamp_(INT4_MIN, INT4_MAX).to(torch.int8)
    return codes.view(out_f, in_f), scale


def generate_tensors(
    specs: list[TensorSpec], seed: int, distribution: CodeDistribution
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) for `specs`; an expert's three tensors come from one generated matrix."""
    int4_cache: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for spec in specs:
        if spec.fill in (Fill.INT4_PACKED, Fill.INT4_SCALE, Fill.INT4_SHAPE):
            module = spec.name.rsplit(".", 1)[0]
            out_f, in_f = spec.matrix_shape
            if spec.fill is Fill.INT4_SHAPE:
                yield spec.name, torch.tensor([out_f, in_f], dtype=torch.int32)
                continue
            if module not in int4_cache:
                int4_cache.clear()  # experts come one module at a time: keep one matrix alive
                int4_cache[module] = synthetic_int4_matrix(module, out_f, in_f, seed, distribution)
            codes, scale = int4_cache[module]
            yield spec.name, (pack_int4(codes) if spec.fill is Fill.INT4_PACKED else scale.clone())
            continue
        gen = _generator(seed, spec.name)
        if spec.fill is Fill.LINEAR:
            yield spec.name, _gaussian_bf16(spec.shape, LINEAR_WEIGHT_STD, gen)
        elif spec.fill is Fill.NORM:
            yield spec.name, (1.0 + 0.05 * torch.randn(spec.shape, generator=gen)).to(spec.dtype)
        else:
            yield spec.name, (0.01 * torch.randn(spec.shape, generator=gen)).to(spec.dtype)
