"""Which tensors a K2-layout checkpoint holds, in what order, and their synthetic contents.

`checkpoint_tensor_specs` lists every tensor (name, shape, dtype, how to fill it) in the order a
real checkpoint stores them (embeddings, then layer by layer, then norm / head / vision), so shards
cut from this list split the way Moonshot's do (an expert's gate and up can land in different
shards). Contents are deterministic per tensor name, seed and device type (cpu / cuda), independent of
sharding, of the number of writing processes and of the order tensors are generated in.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch

from ..checkpoint.k2_config import K2Config
from ..checkpoint.layout import PROJS
from ..checkpoint.writer import spec_nbytes
from ..checkpoint_builder.int4 import SYMMETRIC_INT4_HALF_RANGE, quantize_int4
from ..numerics.constants import INT4_GROUP_SIZE, INT4_MAX, INT4_MIN, INT4_PER_INT32
from ..numerics.int4 import pack_int4

# Standard deviation of synthetic BF16 linear weights (typical of trained LLM projections).
LINEAR_WEIGHT_STD = 0.02
# Per-row spread (log-normal sigma) of expert weight magnitudes, so group scales vary like real ones.
EXPERT_ROW_LOG_STD = 0.3
# Realistic INT4: compressed-tensors' symmetric minmax rule (checkpoint_builder/int4.py: scale = absmax / 7.5),
# so a group's extreme value lands on +7 (clamped from 7.5) or -8, and every one of the 16 codes occurs.
INT4_ABSMAX_DIVISOR = SYMMETRIC_INT4_HALF_RANGE
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
# Contents are a function of (seed, tensor or matrix name, device type): `cpu` gives the pinned bytes every
# test relies on; `cuda` draws from CUDA's Philox generator instead, so its contents differ from the CPU's
# (deterministic for the same seed, GPU model and torch version; same distributions and encoding).
def _generator(seed: int, key: str, device: torch.device | str = "cpu") -> torch.Generator:
    # Seed per tensor (or per expert matrix) so contents do not depend on shard order.
    return torch.Generator(device=device).manual_seed((seed * 1_000_003 + zlib.crc32(key.encode())) % (2**63))


class Workspace:
    """Reusable scratch buffers of one generating process (a new multi-MB tensor per matrix costs page faults).

    Holds one buffer per role and dtype (the largest asked for); its contents are only valid until the next
    request for that role.
    """

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self._buffers: dict[str, torch.Tensor] = {}

    def _get(self, role: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        buf = self._buffers.get(role)
        if buf is None or buf.numel() < numel:
            self._buffers.pop(role, None)
            buf = torch.empty(numel, dtype=dtype, device=device)
            self._buffers[role] = buf
        return buf[:numel]

    def buffer(self, role: str, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A tensor of `shape` on the workspace's device (garbage contents), reused per `role` and dtype."""
        return self._get(f"{role}:{dtype}", math.prod(shape), dtype, self.device).view(shape)


def gaussian_bf16_chunks(
    shape: tuple[int, ...], std: float, gen: torch.Generator, workspace: Workspace
) -> Iterator[tuple[int, torch.Tensor]]:
    """(element offset, bf16 rows) of a Gaussian tensor, `_GENERATE_ROWS` rows of `shape[0]` at a time.

    The rows live in `workspace` buffers: use each chunk before asking for the next.
    """
    rows = shape[0] if len(shape) > 1 else 1
    row_len = math.prod(shape) // rows
    for start in range(0, rows, _GENERATE_ROWS):
        n = min(_GENERATE_ROWS, rows - start)
        x = workspace.buffer("gaussian", (n, row_len))
        torch.randn((n, row_len), generator=gen, out=x)
        yield start * row_len, workspace.buffer("gaussian", (n, row_len), torch.bfloat16).copy_(x.mul_(std))


def synthetic_int4_matrix(
    module: str,
    out_f: int,
    in_f: int,
    seed: int,
    distribution: CodeDistribution,
    device: torch.device | str = "cpu",
    workspace: Workspace | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 codes [out, in], bf16 group scales [out, in/32]) for one expert matrix, on `device`."""
    gen = _generator(seed, module, device)
    groups = in_f // INT4_GROUP_SIZE
    if distribution is CodeDistribution.UNIFORM:
        codes = torch.randint(INT4_MIN, INT4_MAX + 1, (out_f, in_f), generator=gen, dtype=torch.int8, device=device)
        log_scale = torch.rand(out_f, groups, generator=gen, device=device) * 6.0 - 10.0  # scales in [2^-10, 2^-4]
        return codes, torch.exp2(log_scale).to(torch.bfloat16)
    row_std = LINEAR_WEIGHT_STD * torch.exp(torch.randn(out_f, 1, generator=gen, device=device) * EXPERT_ROW_LOG_STD)
    w = (workspace or Workspace(device)).buffer("int4", (out_f, in_f))
    torch.randn((out_f, in_f), generator=gen, out=w)
    return quantize_int4(w.mul_(row_std), in_place=True)


@dataclass(frozen=True)
class WorkUnit:
    """Tensors generated together: one tensor, or the packed weight / scale / shape of one INT4 matrix
    (whichever of them a caller asks for; they may sit in different shards)."""

    specs: tuple[TensorSpec, ...]

    @property
    def cost(self) -> int:
        """Relative generation cost (random numbers drawn, INT4 matrices weighted for their quantization)."""
        spec = self.specs[0]
        if spec.matrix_shape is not None:
            return 3 * spec.matrix_shape[0] * spec.matrix_shape[1]
        return math.prod(spec.shape)


def work_units(specs: list[TensorSpec]) -> list[WorkUnit]:
    """Group `specs` into units (an INT4 matrix's tensors together, at its first tensor's place)."""
    units: list[list[TensorSpec]] = []
    int4_units: dict[str, list[TensorSpec]] = {}
    for spec in specs:
        if spec.matrix_shape is None:
            units.append([spec])
            continue
        module = spec.name.rsplit(".", 1)[0]
        if module not in int4_units:
            int4_units[module] = []
            units.append(int4_units[module])
        int4_units[module].append(spec)
    return [WorkUnit(tuple(u)) for u in units]


def unit_chunks(
    unit: WorkUnit, seed: int, distribution: CodeDistribution, workspace: Workspace
) -> Iterator[tuple[str, int, torch.Tensor]]:
    """Yield (tensor name, byte offset in that tensor, contiguous chunk on the workspace's device) for `unit`.

    Memory: one INT4 matrix, or `_GENERATE_ROWS` rows of a BF16 tensor, at a time; a chunk may live in a
    workspace buffer, so use (write or copy) it before asking for the next.
    """
    device = workspace.device
    first = unit.specs[0]
    if first.matrix_shape is not None:
        module = first.name.rsplit(".", 1)[0]
        out_f, in_f = first.matrix_shape
        codes = scale = None
        if any(s.fill is not Fill.INT4_SHAPE for s in unit.specs):
            codes, scale = synthetic_int4_matrix(module, out_f, in_f, seed, distribution, device, workspace)
        for spec in unit.specs:
            if spec.fill is Fill.INT4_SHAPE:
                yield spec.name, 0, torch.tensor([out_f, in_f], dtype=torch.int32)
            elif spec.fill is Fill.INT4_PACKED:
                yield spec.name, 0, pack_int4(codes)
            else:
                yield spec.name, 0, scale
        return
    gen = _generator(seed, first.name, device)
    if first.fill is Fill.LINEAR:
        for start, chunk in gaussian_bf16_chunks(first.shape, LINEAR_WEIGHT_STD, gen, workspace):
            yield first.name, start * chunk.element_size(), chunk
    elif first.fill is Fill.NORM:
        yield first.name, 0, (1.0 + 0.05 * torch.randn(first.shape, generator=gen, device=device)).to(first.dtype)
    else:
        yield first.name, 0, (0.01 * torch.randn(first.shape, generator=gen, device=device)).to(first.dtype)
