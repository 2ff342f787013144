"""FP8 KV-cache scales for MLA: measure what the cache holds per decoder layer, write Model Optimizer's tensors.

What the cache holds. Under MLA (K2 / DeepSeek-V3) SGLang's `MLATokenToKVPool` stores one row per token and
layer: the compressed latent `c_kv` (`kv_lora_rank` = 512 numbers, after `kv_a_layernorm`) followed by the
roped shared key `k_pe` (`qk_rope_head_dim` = 64, after rotary). Both parts are cast to FP8 with ONE
per-tensor scale: the engines keep a single `k_scale` per attention module
(sglang/srt/layers/quantization/kv_cache.py `process_weights_after_loading`: "Only support per-tensor
scaling factor for fp8 KV cache"), so the amax that matters is the max over latent and rope key.

Names. Model Optimizer's HF export turns the attention's `k_bmm_quantizer._amax` / `v_bmm_quantizer._amax`
into `<attn>.k_proj.k_scale` / `<attn>.v_proj.v_scale` (modelopt/torch/export/quant_utils.py
`postprocess_state_dict`). Our names: `{prefix}model.layers.L.self_attn.k_proj.k_scale` and `...v_proj.v_scale`.
- SGLang 0.5.23 (models/deepseek_common/deepseek_weight_loader.py): a `k_scale`/`v_scale` name not in the
  model's parameters gets `{k,v}_proj` replaced by `attn_mqa` -> `model.layers.L.self_attn.attn_mqa.k_scale`
  (the MLA `RadixAttention`; KimiK25 strips `language_model.` first). `attn_mha` (the prefill MHA path)
  gets no scale and keeps 1.0.
- vLLM 0.33 (model_loader/weight_utils.py `maybe_remap_kv_scale_name`): `.self_attn.{k,v}_proj.{k,v}_scale`
  -> `.self_attn.mla_attn.mla_attn.{k,v}_scale`.

Value: `max(amax / 448, 1.0)`, float32 0-d. Model Optimizer clamps FP8 KV scales to at least 1
(`value.clamp_(min=1.0)`, "Ensure scale is at least 1 for KV_CACHE_FP8"), and SGLang 0.5.23's MLA kernels
depend on it: the cache row is written as a plain FP8 cast (kernels/ops/attention/utils.py
`mla_quantize_and_rope_for_fp8(..., quant_scale_kv=1.0)`, memory_pool.py `_write_mla_kv_buffer`
`.to(self.dtype)`), while decode multiplies the scores by `k_scale` (trtllm_mla_backend.py
`_compute_decode_bmm1_scale`: `q_scale * k_scale * layer.scaling`; FlashMLA uses it as `descale_k`).
An unclamped amax/448 below 1 would scale every attention score of the served model by it
(docs/benchmarks.md §12 measures this). The scale is therefore 1.0 unless the cache really exceeds
FP8's range; such layers are listed in the report (`layers_above_fp8_range`) because SGLang's write
path cannot represent them however the scale is set. `v_scale` gets the same value: the latent is
both the key and the value source, and SGLang's MLA decode does not read it (no bmm2 scale).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict

from ..checkpoint.layout import CheckpointLayout
from ..checkpoint.modelopt_config import load_hf_quant_config
from ..errors import CheckpointError
from ..model.observer import NullObserver
from ..numerics.constants import E4M3_MAX

FP8_KV_CACHE_ALGO = "FP8"
# Model Optimizer's floor for FP8 KV scales (quant_utils.py postprocess_state_dict `clamp_(min=1.0)`).
MIN_FP8_KV_SCALE = 1.0
# Model Optimizer's export names (k_bmm_quantizer / v_bmm_quantizer of the attention module).
K_SCALE_MODULE_SUFFIX = "self_attn.k_proj.k_scale"
V_SCALE_MODULE_SUFFIX = "self_attn.v_proj.v_scale"
KV_SCALE_SUFFIXES = ("." + K_SCALE_MODULE_SUFFIX, "." + V_SCALE_MODULE_SUFFIX)
SCALE_RULE = "max(amax / 448, 1.0)"


def is_kv_cache_scale(name: str) -> bool:
    return name.endswith(KV_SCALE_SUFFIXES)


def kv_scale_from_amax(amax: float) -> float:
    """The FP8 KV scale Model Optimizer exports for a cache amax: amax / 448, at least 1 (see module doc)."""
    return max(float(amax) / E4M3_MAX, MIN_FP8_KV_SCALE)


def fake_quant_fp8(t: torch.Tensor, scale: float) -> torch.Tensor:
    """`t` through an FP8 E4M3 cache with per-tensor `scale`: t / scale, saturated to +-448, rounded to
    float8_e4m3fn, times scale; same dtype as `t`. Saturating first because torch's cast is not (an
    overflow becomes NaN), as the engines' saturating conversion kernels do."""
    q = (t.to(torch.float32) / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return (q.to(torch.float32) * scale).to(t.dtype)


def declared_kv_cache_algo(root: str | Path) -> str | None:
    """The `kv_cache_quant_algo` a converted checkpoint declares (None: `convert --kv-cache none`)."""
    path = Path(root)
    try:
        return load_hf_quant_config(path)["quantization"].get("kv_cache_quant_algo")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"cannot read kv_cache_quant_algo ({e})", file=path / "hf_quant_config.json") from None


class KVCacheRanges(NullObserver):
    """`KVCacheObserver` (model/observer.py; a no-op for linears and router on its own): per decoder layer, the amax of the latent and of the rope key
    over every token the calibration sessions put in the cache. Kept on the device until asked for."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = device
        self.latent: dict[int, torch.Tensor] = {}
        self.rope: dict[int, torch.Tensor] = {}
        self.tokens: dict[int, int] = {}

    def on_kv_cache(self, layer: int, latent: torch.Tensor, k_pe: torch.Tensor) -> None:
        zero = torch.zeros((), dtype=torch.float32, device=self.device)
        for table, t in ((self.latent, latent), (self.rope, k_pe)):
            amax = t.detach().abs().amax().to(device=self.device, dtype=torch.float32) if t.numel() else zero
            table[layer] = torch.maximum(table.get(layer, zero), amax)
        self.tokens[layer] = self.tokens.get(layer, 0) + latent.shape[0]

    def combine_ranks(self, ctx: Any) -> None:
        """Every rank ends with the amax over all ranks' tokens (data parallelism, kimi_nvfp4.distributed)."""
        if not ctx.distributed:
            return
        layers = sorted(set().union(*map(set, ctx.all_gather_object(sorted(self.latent)))))
        zero = torch.zeros((), dtype=torch.float32, device=self.device)
        for table in (self.latent, self.rope):
            both = ctx.all_reduce_max_(torch.stack([table.get(i, zero) for i in layers])) if layers else None
            for k, i in enumerate(layers):
                table[i] = both[k].clone()
        counts = ctx.all_gather_object({i: self.tokens.get(i, 0) for i in layers})
        self.tokens = {i: sum(c.get(i, 0) for c in counts) for i in layers}

    def layers(self) -> list[int]:
        return sorted(self.latent)

    def amax(self, layer: int) -> float:
        """The cache row's amax in `layer`: max over latent and rope key (one scale covers both)."""
        return max(float(self.latent[layer]), float(self.rope[layer]))


class ObserverWithKVCache:
    """`observer` (linear statistics) plus `kv` (cache ranges) as one observer for one attention call."""

    def __init__(self, observer: Any, kv: KVCacheRanges):
        self.observer, self.kv = observer, kv

    @property
    def route_all(self) -> bool:
        return bool(getattr(self.observer, "route_all", False))

    @property
    def needs_outputs(self) -> bool:
        return bool(getattr(self.observer, "needs_outputs", True))

    def on_linear(self, *args: Any, **kwargs: Any) -> None:
        self.observer.on_linear(*args, **kwargs)

    def on_router(self, *args: Any, **kwargs: Any) -> None:
        self.observer.on_router(*args, **kwargs)

    def on_kv_cache(self, layer: int, latent: torch.Tensor, k_pe: torch.Tensor) -> None:
        self.kv.on_kv_cache(layer, latent, k_pe)


def with_kv_cache(observer: Any, kv: KVCacheRanges | None) -> Any:
    """`observer` itself when KV scales are not calibrated, else it and `kv` together."""
    return observer if kv is None else ObserverWithKVCache(observer, kv)


def kv_scale_names(layout: CheckpointLayout, layer: int) -> tuple[str, str]:
    prefix = layout.layer_prefix(layer)
    return prefix + K_SCALE_MODULE_SUFFIX, prefix + V_SCALE_MODULE_SUFFIX


class KVCacheLayer(BaseModel):
    model_config = ConfigDict(extra="forbid", ser_json_inf_nan="constants")

    layer: int
    tokens: int
    latent_amax: float
    rope_amax: float
    amax: float  # max of the two: what one per-tensor scale must cover
    unclamped_scale: float  # amax / 448
    scale: float  # written to k_scale and v_scale


class KVCacheCalibration(BaseModel):
    """The report's record of the FP8 KV-cache scales (calibration.json `kv_cache`)."""

    model_config = ConfigDict(extra="forbid")

    kv_cache_quant_algo: str
    rule: str = SCALE_RULE
    tensors: int
    layers: list[KVCacheLayer]
    layers_above_fp8_range: list[int]  # amax > 448: SGLang's unscaled cache write saturates there


def kv_cache_scales(
    layout: CheckpointLayout, ranges: KVCacheRanges
) -> tuple[dict[str, torch.Tensor], KVCacheCalibration]:
    """`k_scale` and `v_scale` (float32 0-d, the same value) for every measured layer, and the report entry."""
    scales: dict[str, torch.Tensor] = {}
    layers: list[KVCacheLayer] = []
    for layer in ranges.layers():
        amax = ranges.amax(layer)
        scale = kv_scale_from_amax(amax)
        for name in kv_scale_names(layout, layer):
            scales[name] = torch.tensor(scale, dtype=torch.float32)
        layers.append(
            KVCacheLayer(
                layer=layer, tokens=ranges.tokens.get(layer, 0), latent_amax=float(ranges.latent[layer]),
                rope_amax=float(ranges.rope[layer]), amax=amax, unclamped_scale=amax / E4M3_MAX, scale=scale,
            )
        )
    report = KVCacheCalibration(
        kv_cache_quant_algo=FP8_KV_CACHE_ALGO,
        tensors=len(scales),
        layers=layers,
        layers_above_fp8_range=[entry.layer for entry in layers if entry.amax > E4M3_MAX],
    )
    return scales, report


def check_kv_cache_scale(reader: Any, name: str, t: torch.Tensor) -> None:
    """A KV scale must name a decoder layer's MLA attention of this checkpoint and be a positive float32 0-d."""
    module = name.rsplit(".", 2)[0]  # {prefix}model.layers.L.self_attn
    if module + ".kv_a_proj_with_mqa.weight" not in reader:
        raise CheckpointError("no MLA attention of this name in the converted checkpoint", file=reader.root, tensor=name)
    if t.dtype != torch.float32 or t.ndim != 0 or not bool(torch.isfinite(t)) or float(t) < MIN_FP8_KV_SCALE:
        raise ValueError(f"{name}: an FP8 KV scale must be a finite float32 0-d tensor >= 1, got {t}")
