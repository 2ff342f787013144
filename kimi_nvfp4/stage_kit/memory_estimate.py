"""The memory estimate of one model-stage configuration (`estimate`): what calibrate and validate keep alive at
once, as a sum of named components from the checkpoint's config and the ops that hold them. The planner
(memory_plan.py) tries configurations against the memory a stage may use; bench/profile/memory_plan.py compares
the estimate with the measured peak on the H200 (docs/benchmarks.md §16).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from ..checkpoint.k2_config import K2Config
# Chunk-input-sized GPU buffers that host-resident states add (the transfers overlapped with compute: host_states.py).
from ..model.host_states import HOST_TRANSFER_CHUNK_BUFFERS
# Bytes per (token x hidden) value of one MLP/MoE chunk and per routed (token, expert) pair (model/runner.py).
from ..model.moe import DEQUANTIZED_GROUP_BYTES
from ..model.runner import CHUNK_BYTES_PER_VALUE, SORTED_BUFFERS_PER_PAIR
from ..numerics.constants import INT4_GROUP_SIZE

GIB = 2**30
# Kept free besides the plan: the CUDA context's later allocations (cuBLAS workspaces, Triton), the caching
# allocator's fragmentation, attention's per-sequence blocks.
GPU_HEADROOM_BYTES = 3 * GIB
# Kept free on the host for the process itself (Python, torch, tokenizer, page cache of the shards).
HOST_HEADROOM_BYTES = 4 * GIB
# Validate's logits after the last layer (validate/streams.py), per position of one sequence and vocabulary entry:
# every stream's `LayerStreamRunner.logits` generator holds its sequence's logits (`parts`) while suspended, and the
# loop holds the INT4 logits and the logits being compared: streams + LOGITS_EXTRA_COPIES copies in the compute
# dtype; `TokenComparison.add` (validate/metrics.py) then holds LOGITS_FP32_VALUES fp32 values at once (both
# log-softmaxes, `lp_ref.exp()`, `lp_ref - lp_test` and their product).
LOGITS_EXTRA_COPIES = 2
LOGITS_FP32_VALUES = 5


Stage = Literal["calibrate", "validate"]


@dataclass(frozen=True)
class LayerSizes:
    """Bytes of one MoE decoder layer of `cfg` as the runner holds it (the largest layer of a K2 model)."""

    cfg: K2Config
    dtype_bytes: int

    @property
    def expert_values(self) -> int:
        return 3 * self.cfg.hidden_size * self.cfg.moe_intermediate_size * self.cfg.n_routed_experts

    @property
    def experts_stored(self) -> int:
        """Routed experts as loaded: 4-bit codes plus group scales (INT4: bf16 per 32; NVFP4: e4m3 per 16)."""
        return self.expert_values // 2 + self.expert_values // 16

    @property
    def experts_materialized(self) -> int:
        return self.expert_values * self.dtype_bytes

    @property
    def dense(self) -> int:
        """Attention, shared experts and router in the compute dtype (router fp32)."""
        c = self.cfg
        q = (c.hidden_size * c.q_lora_rank + c.q_lora_rank * c.num_attention_heads * c.qk_head_dim) if c.q_lora_rank \
            else c.hidden_size * c.num_attention_heads * c.qk_head_dim
        kv = c.hidden_size * (c.kv_lora_rank + c.qk_rope_head_dim) \
            + c.kv_lora_rank * c.num_attention_heads * (c.qk_nope_head_dim + c.v_head_dim)
        o = c.num_attention_heads * c.v_head_dim * c.hidden_size
        shared = 3 * c.hidden_size * c.moe_intermediate_size * c.n_shared_experts
        dense_mlp = 3 * c.hidden_size * c.intermediate_size if c.first_k_dense_replace else 0
        # layer 0's dense MLP replaces the experts there; the larger of the two is what a layer can hold
        return (q + kv + o + shared) * self.dtype_bytes + c.n_routed_experts * c.hidden_size * 4 \
            + max(0, dense_mlp * self.dtype_bytes - self.experts_stored)

    @property
    def stored(self) -> int:
        return self.experts_stored + self.dense

    @property
    def lm_head(self) -> int:
        return self.cfg.vocab_size * self.cfg.hidden_size * self.dtype_bytes


def _chunk_bytes(cfg: K2Config, tokens: int, dtype_bytes: int) -> int:
    pairs = SORTED_BUFFERS_PER_PAIR * cfg.num_experts_per_tok * dtype_bytes
    return (CHUNK_BYTES_PER_VALUE + pairs) * tokens * cfg.hidden_size


def _validate_chunk_bytes(cfg: K2Config, tokens: int, dtype_bytes: int) -> int:
    """Peak working memory of one MoE chunk of validate on CUDA, as the INT4 stream holds it: it carries the per-expert
    check (validate/experts.py) and holds the most of validate's streams (the NVFP4 streams quantize activations with
    the fused kernel, which leaves no temporaries: model/linear.py). Per (token x hidden) value of the chunk:
    - the chunk input (`x = torch.cat(...)`), the previous chunk's output (bound to `y` in
      `LayerStreamRunner.feed_forward` until the next `mlp_block` returns) and the normed input: 3 values;
    - the expert-sorted gather `rows` [T*k, hidden]: `del rows` in moe.py `_routed_sorted` does not free it, the
      observer's view of the last expert's rows (`x_seen = rows[a:b]`) stays bound until the function returns: k;
    - then the largest of: gate, up and the SwiGLU's two temporaries (4 buffers [T*k, inter]); h and the expert
      outputs `y` [T*k, hidden]; `y` and the fp32 combine (`out = out + y[...].to(float32) * w`: `out`, the upcast
      rows and their weighted copy, 3 x 4 bytes).
    The shared formula (`_chunk_bytes`, 88 bytes per value at K2.6's top-8 in bf16) counts three sorted buffers and
    the reference quantizer's temporaries; validate's INT4 chunk holds 50."""
    b, k = dtype_bytes, cfg.num_experts_per_tok
    inter = k * cfg.moe_intermediate_size * b / cfg.hidden_size  # one [T*k, inter] buffer, per (token x hidden)
    rows = k * b
    per_value = 3 * b + rows + max(4 * inter, inter + rows, rows + 3 * 4)
    return int(per_value * tokens * cfg.hidden_size)


def estimate(cfg: K2Config, *, stage: Stage, device: torch.device, dtype: torch.dtype, tokens: int, seq_len: int,
             streams: int, sources: int, states_on_device: bool, chunk_tokens: int, materialize: bool,
             prefetch: bool, baseline: bool = False) -> tuple[int | None, int, dict[str, int]]:
    """(peak GPU bytes or None on CPU, peak host bytes, components) of one configuration.

    Validate's terms are what validate/streams.py keeps alive at the same time in a MoE layer with a MoE layer before
    it and one after it (every MoE layer of a K2 model but the first and the last):
    - its INT4 stream's MoE chunks (the layer phase): every stream plus one -- `del ref_states` leaves the INT4 input
      bound to `new_ref` until `ref_runner.feed_forward` returns the INT4 output --, both checkpoints' layers, both
      next layers prefetched, the baseline's experts and the INT4 chunk;
    - the amax baseline's conversion (`baseline_layer`, before the INT4 stream): the layers, one routed expert
      unpacked (int8 codes and fp32 group scales of its `Int4Matrix`es; the experts are converted one at a time) and
      the NVFP4 tensors made so far;
    - the logits after the last layer: every stream (not one more), the heads and one sequence's logits work."""
    size = LayerSizes(cfg, torch.empty((), dtype=dtype).element_size())
    stream = tokens * cfg.hidden_size * size.dtype_bytes
    chunk = min(chunk_tokens, max(tokens, 1))
    on_gpu = device.type == "cuda"
    validating = stage == "validate"
    dequantized = size.experts_materialized if materialize else 0
    comp = {
        # every stream, and the post-attention residual of the one being stepped
        "hidden_states": (streams + 1) * stream,
        "layers_stored": sources * size.stored,
        # the prefetch thread dequantizes the next layers as it loads them (runner.py `_load`): counted for validate;
        # calibrate's accounting is left as measured (docs/benchmarks.md §16), its other terms count more than it holds
        "next_layers_prefetched": sources * (size.stored + (dequantized if validating else 0)) if prefetch else 0,
        # validate dequantizes the INT4 layer and the NVFP4 layer; calibrate its one layer
        "layers_dequantized": sources * dequantized,
        # validate on CUDA: what its INT4 stream's chunk holds; elsewhere the shared count (reference quantizer)
        "chunk_work": _validate_chunk_bytes(cfg, chunk, size.dtype_bytes) if validating and on_gpu
        else _chunk_bytes(cfg, chunk, size.dtype_bytes),
        # a layer not dequantized once decodes its experts per chunk, a group of them at a time for one grouped
        # launch (moe.py `_expert_products`)
        "experts_decoded_per_chunk": 0 if materialize else min(DEQUANTIZED_GROUP_BYTES, size.experts_materialized),
        # validate's amax baseline: its own routed experts beside the checkpoint's (validate/baseline.py), as
        # converted: nothing dequantizes them once (the runner materializes only the layers it loads, and validate
        # passes its plan's True/False, never "auto"), and the checkpoint's dequantized copies are dropped before the
        # baseline stream runs
        "baseline_experts": size.experts_stored if baseline else 0,
        # `baseline_layer` unpacks one routed expert at a time (`Int4Matrix.from_packed`: int8 codes and fp32 group
        # scales) and converts it
        "baseline_build": (size.expert_values + size.expert_values // INT4_GROUP_SIZE * 4) // cfg.n_routed_experts
        if baseline else 0,
    }
    # validate's end: every stream, one lm_head per checkpoint, one sequence's logits (LOGITS_EXTRA_COPIES)
    per_position = (streams + LOGITS_EXTRA_COPIES) * size.dtype_bytes + LOGITS_FP32_VALUES * 4
    logits = sources * size.lm_head + per_position * min(seq_len, tokens) * cfg.vocab_size
    comp["logits_work"] = logits if validating else 0

    def states_gpu(n: int) -> int:
        """`n` streams where the compute sees them: all of them on the device, or one sequence's copies per stream."""
        return n * stream if states_on_device else 2 * seq_len * cfg.hidden_size * size.dtype_bytes * 2

    # host states: the next chunk uploading, the previous one still computing and its output downloading
    comp["host_transfer_buffers"] = 0 if states_on_device or not on_gpu \
        else HOST_TRANSFER_CHUNK_BUFFERS * chunk * cfg.hidden_size * size.dtype_bytes
    layers = comp["layers_stored"] + comp["next_layers_prefetched"] + comp["layers_dequantized"]
    layer_phase = states_gpu(streams + 1) + layers + comp["chunk_work"] + comp["experts_decoded_per_chunk"] \
        + comp["baseline_experts"] + comp["host_transfer_buffers"]
    baseline_phase = states_gpu(streams) + layers + comp["baseline_build"] + comp["baseline_experts"] \
        if baseline else 0
    logits_phase = states_gpu(streams) + comp["logits_work"]
    embed = cfg.vocab_size * cfg.hidden_size * 2  # the embedding table stays on the host (bf16)
    host_states = 0 if states_on_device else comp["hidden_states"]
    if on_gpu:
        comp["gpu_headroom"] = GPU_HEADROOM_BYTES
        gpu = max(layer_phase, baseline_phase, logits_phase) + GPU_HEADROOM_BYTES
        # layers are read into host memory before the upload (one per source, two while prefetching)
        host = host_states + embed + (2 if prefetch else 1) * comp["layers_stored"] + HOST_HEADROOM_BYTES
        return gpu, host, comp
    host = max(layer_phase, baseline_phase, logits_phase) + embed + HOST_HEADROOM_BYTES
    return None, host, comp


__all__ = ["GIB", "GPU_HEADROOM_BYTES", "HOST_HEADROOM_BYTES", "LOGITS_EXTRA_COPIES", "LOGITS_FP32_VALUES",
           "LayerSizes", "Stage", "estimate"]
