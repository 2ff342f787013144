"""Per-layer weight loading from a K2 checkpoint: the INT4 source or the converted NVFP4 output.

A `WeightSource` hands out one decoder layer at a time (`.layer(i, device)`), so the caller holds one
layer plus activations, never the model. Both checkpoint layouts work (K2.6 `language_model.` prefix,
K2-Thinking none): names come from `CheckpointLayout`. Every tensor is checked against the shape the
config implies; a mismatch or a missing tensor raises `CheckpointError` naming file and tensor.

Which linear is what is read from the tensors themselves: `X.weight_packed` -> INT4 (compressed-tensors
pack-quantized), `X.weight` uint8 -> NVFP4 (ModelOpt), `X.weight` float -> BF16. `Int4SourceWeights`
refuses NVFP4 tensors and `NVFP4Weights` refuses INT4 ones, so a wrong `kind` never runs silently.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from ..checkpoint.k2_config import K2Config
from ..checkpoint.layout import PROJS
from ..checkpoint.modelopt_config import HF_QUANT_CONFIG_NAME
from ..checkpoint.reader import INDEX_NAME, CheckpointReader
from ..errors import CheckpointError, UnsupportedCheckpointError
from ..numerics.constants import INT4_GROUP_SIZE, INT4_PER_INT32, NVFP4_BLOCK_SIZE
from .layer_weights import AttentionWeights, LayerWeights, MLPWeights, MoEWeights
from .linear import DenseLinear, Int4Linear, Linear, NVFP4Linear
from .nvfp4_linears import InputScaleReduction, Nvfp4LinearBuilder, RawNvfp4, replace_weights


def upload(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`t.to(device)`; to CUDA through page-locked staging, without waiting for the copy.

    A checkpoint tensor is a view of the shard's memory map; its pageable copy to the GPU is staged by the
    driver through a small bounce buffer and blocks the loading thread (the largest device item in the
    session-4/5 profiles). Here the host copies it once into page-locked memory from PyTorch's caching host
    allocator, and the DMA runs asynchronously on the current stream; the allocator does not hand that block
    out again before the copy's event has completed, so blocks cycle through a layer's tensors. Callers that
    use the result on another stream synchronise first (`LayerStreamRunner._load` does).
    """
    device = torch.device(device)
    if device.type != "cuda":
        return t.to(device)
    staged = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    staged.copy_(t)
    return staged.to(device, non_blocking=True)


@runtime_checkable
class WeightSource(Protocol):
    config: K2Config

    def layer(self, i: int, device: torch.device | str, dtype: torch.dtype = torch.float32) -> LayerWeights: ...
    def embed(self, device: torch.device | str) -> torch.Tensor: ...
    def final_norm(self, device: torch.device | str) -> torch.Tensor: ...
    def lm_head(self, device: torch.device | str) -> torch.Tensor: ...


class _CheckpointWeights:
    """Shared loading; subclasses decide what a quantized linear becomes."""

    kind_name = "checkpoint"

    def __init__(self, reader: CheckpointReader | str | Path):
        self.reader = reader if isinstance(reader, CheckpointReader) else CheckpointReader(reader)
        self.layout = self.reader.layout
        self.config: K2Config = self.layout.text
        if self.config.hidden_act != "silu":
            raise UnsupportedCheckpointError(
                f"hidden_act {self.config.hidden_act!r} is not supported (K2 uses 'silu')", file="config.json"
            )

    # --- tensors -------------------------------------------------------------------------------
    def _file_of(self, name: str) -> str:
        return self.reader.weight_map.get(name, INDEX_NAME)

    def _tensor(self, name: str, shape: tuple[int, ...] | None, device) -> torch.Tensor:
        t = self.reader.load(name)
        if shape is not None and tuple(t.shape) != tuple(shape):
            raise CheckpointError(
                f"shape {tuple(t.shape)} does not match the config's {tuple(shape)}",
                file=self._file_of(name), tensor=name,
            )
        return upload(t, device)

    def _scalar(self, name: str, device) -> torch.Tensor:
        """A per-tensor fp32 scale (ModelOpt stores 0-d; a 1-element tensor is accepted too)."""
        t = self._tensor(name, None, device)
        if t.numel() != 1 or not t.is_floating_point():
            raise CheckpointError(
                f"expected one float scale, got {t.dtype} {tuple(t.shape)}", file=self._file_of(name), tensor=name
            )
        return t.to(torch.float32).reshape(())

    def _norm(self, layer: int, rel: str, n: int, device) -> torch.Tensor:
        return self._tensor(f"{self.layout.layer_prefix(layer)}{rel}.weight", (n,), device).to(torch.float32)

    def embed(self, device) -> torch.Tensor:
        c = self.config
        return self._tensor(self.layout.embed_name, (c.vocab_size, c.hidden_size), device)

    def final_norm(self, device) -> torch.Tensor:
        return self._tensor(self.layout.final_norm_name, (self.config.hidden_size,), device).to(torch.float32)

    def lm_head(self, device) -> torch.Tensor:
        c = self.config
        name = self.layout.lm_head_name
        if name not in self.reader and c.tie_word_embeddings:
            return self.embed(device)
        return self._tensor(name, (c.vocab_size, c.hidden_size), device)

    # --- linears -------------------------------------------------------------------------------
    def _linear_format(self, full: str) -> str:
        if f"{full}.weight_packed" in self.reader:
            return "int4"
        if f"{full}.weight" not in self.reader:
            raise CheckpointError(
                "linear has neither .weight nor .weight_packed", file=INDEX_NAME, tensor=f"{full}.weight"
            )
        return "nvfp4" if self.reader.info(f"{full}.weight").dtype == torch.uint8 else "dense"

    def _load_int4(self, layer: int, rel: str, out_f: int, in_f: int, device, dtype) -> Int4Linear:
        full = f"{self.layout.layer_prefix(layer)}{rel}"
        shape = self._tensor(f"{full}.weight_shape", (2,), "cpu").tolist() if f"{full}.weight_shape" in self.reader else None
        if shape is not None and shape != [out_f, in_f]:
            raise CheckpointError(
                f"weight_shape {shape} does not match the config's [{out_f}, {in_f}]",
                file=self._file_of(f"{full}.weight_shape"), tensor=f"{full}.weight_shape",
            )
        words, groups = -(-in_f // INT4_PER_INT32), -(-in_f // INT4_GROUP_SIZE)
        packed = self._tensor(f"{full}.weight_packed", (out_f, words), device)
        if packed.dtype != torch.int32:
            raise CheckpointError(f"expected int32 packed codes, got {packed.dtype}",
                                  file=self._file_of(f"{full}.weight_packed"), tensor=f"{full}.weight_packed")
        scale = self._tensor(f"{full}.weight_scale", (out_f, groups), device)
        return Int4Linear(rel, packed, scale, in_f, dtype)

    def _load_raw_nvfp4(self, layer: int, rel: str, out_f: int, in_f: int, device) -> RawNvfp4:
        full = f"{self.layout.layer_prefix(layer)}{rel}"
        weight = self._tensor(f"{full}.weight", (out_f, in_f // 2), device)
        scale = self._tensor(f"{full}.weight_scale", (out_f, in_f // NVFP4_BLOCK_SIZE), device)
        if scale.dtype != torch.float8_e4m3fn:
            raise CheckpointError(f"expected float8_e4m3fn block scales, got {scale.dtype}",
                                  file=self._file_of(f"{full}.weight_scale"), tensor=f"{full}.weight_scale")
        scale_2 = self._scalar(f"{full}.weight_scale_2", device)
        input_scale = self._scalar(f"{full}.input_scale", device) if f"{full}.input_scale" in self.reader else None
        return RawNvfp4(rel, full, self._file_of(f"{full}.weight"), weight, scale, scale_2, input_scale)

    def _load_group(self, layer: int, specs: list[tuple[str, int, int]], device, dtype, experts: bool) -> dict[str, Linear]:
        """Load linears that the engine treats together (an expert set, or a fused dense group)."""
        out: dict[str, Linear] = {}
        raw: list[RawNvfp4] = []
        for rel, out_f, in_f in specs:
            full = f"{self.layout.layer_prefix(layer)}{rel}"
            fmt = self._linear_format(full)
            self._check_format(fmt, full)
            if fmt == "dense":
                out[rel] = DenseLinear(rel, self._tensor(f"{full}.weight", (out_f, in_f), device), dtype)
            elif fmt == "int4":
                out[rel] = self._load_int4(layer, rel, out_f, in_f, device, dtype)
            else:
                raw.append(self._load_raw_nvfp4(layer, rel, out_f, in_f, device))
        if raw:
            out.update(self._build_nvfp4(layer, raw, dtype, experts))
        return out

    def _check_format(self, fmt: str, full: str) -> None:
        pass

    def _build_nvfp4(self, layer: int, raw: list[RawNvfp4], dtype, experts: bool) -> dict[str, Linear]:
        raise NotImplementedError

    # --- a layer -------------------------------------------------------------------------------
    def _attention(self, i: int, device, dtype) -> AttentionWeights:
        c = self.config
        n_h = c.num_attention_heads
        a = "self_attn."
        first = [(f"{a}kv_a_proj_with_mqa", c.kv_lora_rank + c.qk_rope_head_dim, c.hidden_size)]
        if c.q_lora_rank is not None:
            first.insert(0, (f"{a}q_a_proj", c.q_lora_rank, c.hidden_size))
        # SGLang fuses q_a_proj + kv_a_proj_with_mqa into `fused_qkv_a_proj_with_mqa` (deepseek_v2.py)
        lin = self._load_group(i, first, device, dtype, experts=False)
        rest = [
            (f"{a}kv_b_proj", n_h * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank),
            (f"{a}o_proj", c.hidden_size, n_h * c.v_head_dim),
        ]
        if c.q_lora_rank is not None:
            rest.append((f"{a}q_b_proj", n_h * c.qk_head_dim, c.q_lora_rank))
        else:
            rest.append((f"{a}q_proj", n_h * c.qk_head_dim, c.hidden_size))
        for spec in rest:
            lin.update(self._load_group(i, [spec], device, dtype, experts=False))
        return AttentionWeights(
            kv_a_proj_with_mqa=lin[f"{a}kv_a_proj_with_mqa"],
            kv_a_layernorm=self._norm(i, f"{a}kv_a_layernorm", c.kv_lora_rank, device),
            kv_b_proj=lin[f"{a}kv_b_proj"],
            o_proj=lin[f"{a}o_proj"],
            q_proj=lin.get(f"{a}q_proj"),
            q_a_proj=lin.get(f"{a}q_a_proj"),
            q_a_layernorm=self._norm(i, f"{a}q_a_layernorm", c.q_lora_rank, device) if c.q_lora_rank else None,
            q_b_proj=lin.get(f"{a}q_b_proj"),
        )

    def _swiglu(self, i: int, prefix: str, width: int, device, dtype) -> MLPWeights:
        h = self.config.hidden_size
        # SGLang fuses gate_proj + up_proj into one MergedColumnParallelLinear `gate_up_proj`
        gate_up = self._load_group(i, [(f"{prefix}.gate_proj", width, h), (f"{prefix}.up_proj", width, h)], device, dtype, False)
        down = self._load_group(i, [(f"{prefix}.down_proj", h, width)], device, dtype, False)
        return MLPWeights(gate_up[f"{prefix}.gate_proj"], gate_up[f"{prefix}.up_proj"], down[f"{prefix}.down_proj"])

    def _moe(self, i: int, device, dtype) -> MoEWeights:
        c = self.config
        h, width, n_e = c.hidden_size, c.moe_intermediate_size, c.n_routed_experts
        specs = []
        for e in range(n_e):
            specs += [(f"mlp.experts.{e}.gate_proj", width, h), (f"mlp.experts.{e}.up_proj", width, h),
                      (f"mlp.experts.{e}.down_proj", h, width)]
        lin = self._load_group(i, specs, device, dtype, experts=True)
        experts = [MLPWeights(*(lin[f"mlp.experts.{e}.{p}"] for p in PROJS)) for e in range(n_e)]
        prefix = self.layout.layer_prefix(i)
        bias_name = f"{prefix}mlp.gate.e_score_correction_bias"
        bias = self._tensor(bias_name, (n_e,), device).to(torch.float32) if bias_name in self.reader else None
        if bias is None and c.topk_method == "noaux_tc":
            raise CheckpointError("topk_method noaux_tc needs the router correction bias", file=INDEX_NAME, tensor=bias_name)
        shared = None
        if c.n_shared_experts:
            shared = self._swiglu(i, "mlp.shared_experts", width * c.n_shared_experts, device, dtype)
        return MoEWeights(
            router_weight=self._tensor(f"{prefix}mlp.gate.weight", (n_e, h), device).to(torch.float32),
            e_score_correction_bias=bias,
            experts=experts,
            shared_experts=shared,
        )

    def layer(self, i: int, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> LayerWeights:
        c = self.config
        if not 0 <= i < c.num_hidden_layers:
            raise IndexError(f"layer {i} out of range (the model has {c.num_hidden_layers})")
        mlp = self._moe(i, device, dtype) if c.is_moe_layer(i) else self._swiglu(i, "mlp", c.intermediate_size, device, dtype)
        return LayerWeights(
            index=i,
            input_layernorm=self._norm(i, "input_layernorm", c.hidden_size, device),
            post_attention_layernorm=self._norm(i, "post_attention_layernorm", c.hidden_size, device),
            self_attn=self._attention(i, device, dtype),
            mlp=mlp,
        )

    def close(self) -> None:
        self.reader.close()


class Int4SourceWeights(_CheckpointWeights):
    """The Kimi K2.x source: routed experts INT4 (dequantized exactly), everything else BF16."""

    kind_name = "int4"

    def _check_format(self, fmt: str, full: str) -> None:
        if fmt == "nvfp4":
            raise CheckpointError(
                "is an NVFP4 (uint8) weight: this is a converted checkpoint, open it with NVFP4Weights / kind='nvfp4'",
                file=self._file_of(f"{full}.weight"), tensor=f"{full}.weight",
            )


class NVFP4Weights(_CheckpointWeights):
    """A converted ModelOpt-NVFP4 checkpoint, emulating SGLang's `modelopt_fp4` kernels.

    `activations`: "w4a4" (Blackwell; needs every expert's input_scale, from the checkpoint or from
    `input_scales`) or "w4a16" (Hopper/Ampere Marlin; weights only). `input_scales` maps tensor names
    (`...experts.3.gate_proj.input_scale`) or module names, with or without the `language_model.`
    prefix, to fp32 scalars; they override the checkpoint's. `input_scale_reduction`: "layer_max"
    (SGLang flashinfer backends: one scale per MoE layer) or "per_expert" (the plain CUTLASS path).
    """

    kind_name = "nvfp4"

    def __init__(
        self,
        reader: CheckpointReader | str | Path,
        activations: str = "w4a4",
        input_scales: Mapping[str, torch.Tensor | float] | None = None,
        input_scale_reduction: str = "layer_max",
    ):
        super().__init__(reader)
        self.builder = Nvfp4LinearBuilder(
            activations=activations,
            reduction=InputScaleReduction(input_scale_reduction),
            overrides=_normalise_scale_keys(input_scales or {}, self.layout.text_prefix),
        )

    @property
    def activations(self) -> str:
        return self.builder.mode.value

    def _check_format(self, fmt: str, full: str) -> None:
        if fmt == "int4":
            raise CheckpointError(
                "is an INT4 (pack-quantized) weight: this is the source checkpoint, open it with Int4SourceWeights",
                file=self._file_of(f"{full}.weight_packed"), tensor=f"{full}.weight_packed",
            )

    def _build_nvfp4(self, layer: int, raw: list[RawNvfp4], dtype, experts: bool) -> dict[str, Linear]:
        return self.builder.build(layer, raw, dtype, experts=experts)

    def set_activations(
        self,
        w: LayerWeights,
        activations: str,
        input_scales: Mapping[str, torch.Tensor | float] | None = None,
    ) -> None:
        """Switch an already loaded layer's NVFP4 linears to `activations` ("w4a4"/"w4a16"), with
        `input_scales` (same keys as the constructor's) on top of this source's own overrides.

        Same result as loading the layer from a source opened with those options, without reading
        the checkpoint again; weights (and dequantized copies, if materialized) are kept. Calibrate
        observes a layer in W4A16 and then advances it in W4A4 with the scales it just chose.
        """
        overrides = {**self.builder.overrides, **_normalise_scale_keys(input_scales or {}, self.layout.text_prefix)}
        builder = Nvfp4LinearBuilder(activations=activations, reduction=self.builder.reduction, overrides=overrides)
        builder.reconfigure([lin for lin in w.linears() if isinstance(lin, NVFP4Linear)])

    def replace_weights(self, w: LayerWeights, tensors: Mapping[str, torch.Tensor]) -> int:
        """Replace NVFP4 weights of an already loaded layer `w` with `tensors` (checkpoint names,
        `...layers.N.mlp.experts.3.gate_proj.weight` / `.weight_scale` / `.weight_scale_2`, each module's three),
        keeping its activation mode and input scales (nvfp4_linears.replace_weights). Returns the linears replaced."""
        prefix = self.layout.layer_prefix(w.index)
        new: dict[str, dict[str, torch.Tensor]] = {}
        for name, value in tensors.items():
            if not name.startswith(prefix):
                raise ValueError(f"{name}: not a tensor of layer {w.index}")
            module, _, suffix = name[len(prefix):].rpartition(".")
            new.setdefault(module, {})[suffix] = value
        for module, parts in new.items():
            if set(parts) != {"weight", "weight_scale", "weight_scale_2"}:
                raise ValueError(f"{prefix}{module}: needs weight, weight_scale and weight_scale_2, got {sorted(parts)}")
        return replace_weights([lin for lin in w.linears() if isinstance(lin, NVFP4Linear)], new)


def _normalise_scale_keys(scales: Mapping[str, Any], text_prefix: str) -> dict[str, torch.Tensor]:
    """`[language_model.]model.layers.N.<module>[.input_scale]` -> `model.layers.N.<module>`."""
    out = {}
    for key, value in scales.items():
        k = key.removesuffix(".input_scale")
        if text_prefix and k.startswith(text_prefix):
            k = k[len(text_prefix):]
        out[k] = torch.as_tensor(value, dtype=torch.float32).reshape(())
    return out


def detect_checkpoint_kind(reader: CheckpointReader) -> str:
    """'nvfp4' for a ModelOpt NVFP4 checkpoint, 'int4' for the compressed-tensors source (or BF16)."""
    if (reader.root / HF_QUANT_CONFIG_NAME).is_file():
        return "nvfp4"
    for qc in (reader.config.get("quantization_config"), reader.layout.text_config_dict.get("quantization_config")):
        method = (qc or {}).get("quant_method")
        if method == "modelopt":
            return "nvfp4"
        if method == "compressed-tensors":
            return "int4"
    for name, info in reader.tensors.items():
        if ".mlp.experts." in name and name.endswith(".weight") and info.dtype == torch.uint8:
            return "nvfp4"
    return "int4"


def open_weights(path: str | Path | CheckpointReader, kind: str = "auto", **kw: Any) -> WeightSource:
    """Open a checkpoint folder as a WeightSource; `kind` "auto" reads config.json / hf_quant_config.json.

    Keyword arguments go to NVFP4Weights (activations, input_scales, input_scale_reduction).
    """
    reader = path if isinstance(path, CheckpointReader) else CheckpointReader(path)
    if kind == "auto":
        kind = detect_checkpoint_kind(reader)
    if kind == "int4":
        if kw:
            raise TypeError(f"Int4SourceWeights takes no options, got {sorted(kw)}")
        return Int4SourceWeights(reader)
    if kind == "nvfp4":
        return NVFP4Weights(reader, **kw)
    raise ValueError(f"kind must be 'auto', 'int4' or 'nvfp4', got {kind!r}")
