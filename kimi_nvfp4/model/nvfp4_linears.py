"""How SGLang turns a layer's NVFP4 tensors into kernel parameters, and the same rules here.

Rules (sglang python/sglang/srt/layers/quantization/modelopt_quant.py, ModelOptNvFp4FusedMoEMethod
and ModelOptFp4LinearMethod `process_weights_after_loading`):
- Routed experts, gate (w1) and up (w3) are one GEMM (w13). SGLang 0.5.23 stores both tensor scales
  (`w13_weight_scale_2` [E, 2]); its TRT-LLM/CUTLASS paths use both (`_compute_gemm1_alphas`:
  g1_alphas, g1_alphas_up), its Marlin path keeps gate's (`w13_weight_scale_2[:, 0]`, a mismatch only
  logs "w1_weight_scale_2 must match w3_weight_scale_2"). Our checkpoints give gate and up one shared
  scale, so every path agrees; here up is dequantized with gate's (the Marlin rule), which a checkpoint
  with unequal halves would show in validation.
- Expert input scales on the flashinfer backends (`flashinfer_trtllm`, the Blackwell default for
  Kimi; and `flashinfer_cutlass`): `w13_input_scale = layer.w13_input_scale.max()`,
  `w2_input_scale = layer.w2_input_scale.max()` -- ONE activation scale per MoE layer for gate/up
  (max over every expert's gate and up) and one for down. Reduction "layer_max".
  The plain CUTLASS path instead uses `w13_input_scale.max(dim=1)` (per expert, max of gate/up) and
  per-expert `w2_input_scale`: reduction "per_expert".
- Fused dense NVFP4 linears (gate_up_proj of the dense MLP / shared expert; fused_qkv_a_proj_with_mqa)
  take `input_scale.max()` and `weight_scale_2.max()` over the fused parts WITHOUT requantizing.

Each built linear remembers its `Nvfp4Group` (the raw tensors the rules were applied to, no copies),
so `Nvfp4LinearBuilder.reconfigure` can move an already loaded layer to another activation mode or
other input scales without reloading or re-dequantizing it (calibrate: observe W4A16, advance W4A4).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from enum import Enum

import torch

from ..errors import CheckpointError
from .linear import ActivationMode, Linear, NVFP4Linear, NVFP4Tensor


class InputScaleReduction(str, Enum):
    LAYER_MAX = "layer_max"
    PER_EXPERT = "per_expert"


@dataclass
class RawNvfp4:
    """One NVFP4 linear's tensors as stored, before the engine's loading rules are applied."""

    rel: str  # module name inside the layer, e.g. "mlp.experts.3.gate_proj"
    full: str  # module name with prefix, for error messages
    file: str
    weight: torch.Tensor
    weight_scale: torch.Tensor
    weight_scale_2: torch.Tensor  # fp32 0-d
    input_scale: torch.Tensor | None  # fp32 0-d

    @property
    def expert_and_proj(self) -> tuple[int, str]:
        parts = self.rel.split(".")  # mlp.experts.E.proj
        return int(parts[2]), parts[3]


@dataclass
class Nvfp4Group:
    """Linears the engine loads together (a layer's routed experts, or one fused dense group).

    Held by each of its linears (`NVFP4Linear.group`); it references the linears' own tensors, never
    the linears (no reference cycle: a layer is freed as soon as its last user drops it)."""

    layer: int
    raw: list[RawNvfp4]
    experts: bool


def _max(scales: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack(scales).max()


class Nvfp4LinearBuilder:
    def __init__(self, activations: str, reduction: InputScaleReduction, overrides: Mapping[str, torch.Tensor]):
        self.mode = ActivationMode(activations)
        self.reduction = reduction
        self.overrides = dict(overrides)

    def _input_scale(self, layer: int, r: RawNvfp4) -> torch.Tensor | None:
        override = self.overrides.get(f"model.layers.{layer}.{r.rel}")
        if override is not None:
            return override.to(r.weight.device)
        if r.input_scale is None and self.mode is ActivationMode.W4A4:
            raise CheckpointError(
                "has no input_scale, which W4A4 emulation needs (run `kimi-nvfp4 calibrate`, pass "
                "input_scales=, or emulate W4A16)",
                file=r.file, tensor=f"{r.full}.input_scale",
            )
        return r.input_scale

    def build(
        self, layer: int, raw: list[RawNvfp4], dtype: torch.dtype, *, experts: bool
    ) -> dict[str, Linear]:
        group = Nvfp4Group(layer, list(raw), experts)
        act = self.activation_scales(group)
        if experts:
            scale_2 = _expert_weight_scales_2(raw)
        else:
            scale_2 = {r.rel: _max([x.weight_scale_2 for x in raw]) for r in raw}
        out: dict[str, Linear] = {}
        for r in raw:
            lin = NVFP4Linear(
                r.rel,
                NVFP4Tensor(weight=r.weight, weight_scale=r.weight_scale, weight_scale_2=scale_2[r.rel]),
                dtype,
                input_scale=act[r.rel],
                mode=self.mode,
            )
            lin.group = group
            out[r.rel] = lin
        return out

    def reconfigure(self, linears: list[NVFP4Linear]) -> None:
        """Apply this builder's mode and input scales to linears another builder built (same rules as
        `build`, same weights, dequantized copies kept). Every linear must carry its `group`."""
        groups: dict[int, tuple[Nvfp4Group, list[NVFP4Linear]]] = {}
        for lin in linears:
            group = getattr(lin, "group", None)
            if group is None:
                raise ValueError(f"{lin.module}: not built by Nvfp4LinearBuilder, cannot be reconfigured")
            groups.setdefault(id(group), (group, []))[1].append(lin)
        for group, members in groups.values():
            act = self.activation_scales(group)
            for lin in members:
                lin.set_activations(self.mode, act[lin.module])

    def activation_scales(self, group: Nvfp4Group) -> dict[str, torch.Tensor | None]:
        """The input scale each linear of `group` runs with (None for all in W4A16)."""
        if self.mode is not ActivationMode.W4A4:
            return {r.rel: None for r in group.raw}
        scales = {r.rel: self._input_scale(group.layer, r) for r in group.raw}
        if group.experts:
            return self._expert_input_scales(group.raw, scales)
        fused = _max([scales[x.rel] for x in group.raw])
        return {r.rel: fused for r in group.raw}

    def _expert_input_scales(self, raw: list[RawNvfp4], scales: dict) -> dict[str, torch.Tensor | None]:
        by_expert = _by_expert(raw)
        act: dict[str, torch.Tensor | None] = {r.rel: None for r in raw}
        w13 = [r for r in raw if r.expert_and_proj[1] != "down_proj"]
        w2 = [r for r in raw if r.expert_and_proj[1] == "down_proj"]
        if self.reduction is InputScaleReduction.LAYER_MAX:
            w13_scale = _max([scales[r.rel] for r in w13]) if w13 else None
            w2_scale = _max([scales[r.rel] for r in w2]) if w2 else None
            for r in w13:
                act[r.rel] = w13_scale
            for r in w2:
                act[r.rel] = w2_scale
        else:
            for projs in by_expert.values():
                pair = [scales[r.rel] for p, r in projs.items() if p != "down_proj"]
                w13_scale = _max(pair) if pair else None  # one tensor for gate and up: quantized once
                for p, r in projs.items():
                    act[r.rel] = scales[r.rel] if p == "down_proj" else w13_scale
        return act


def replace_weights(linears: list[NVFP4Linear], new: Mapping[str, Mapping[str, torch.Tensor]]) -> int:
    """Give already built linears other weights: `new` maps a module (`mlp.experts.3.gate_proj`) to its
    `weight`, `weight_scale` and `weight_scale_2`. The loading rules are applied again over each touched group
    (up_proj takes gate_proj's weight_scale_2), on the group's device; activation mode and input scales are kept;
    a materialized linear is dequantized again from its new weight. Returns the number of linears replaced.
    (calibrate --method gptq --propagation sequential: the advance pass runs the requantized experts.)"""
    by_module = {lin.module: lin for lin in linears}
    unknown = sorted(set(new) - set(by_module))
    if unknown:
        raise ValueError(f"no loaded NVFP4 linear {unknown[0]} (of {len(unknown)}) to replace the weights of")
    groups: dict[int, Nvfp4Group] = {}
    for module in new:
        group = getattr(by_module[module], "group", None)
        if group is None:
            raise ValueError(f"{module}: not built by Nvfp4LinearBuilder, its weights cannot be replaced")
        groups[id(group)] = group
    for group in groups.values():
        for i, r in enumerate(group.raw):
            if r.rel in new:
                t = new[r.rel]
                group.raw[i] = replace(
                    r, weight=t["weight"].to(r.weight.device),
                    weight_scale=t["weight_scale"].to(r.weight_scale.device),
                    weight_scale_2=t["weight_scale_2"].to(device=r.weight_scale_2.device, dtype=torch.float32))
        if group.experts:
            scale_2 = _expert_weight_scales_2(group.raw)
        else:
            scale_2 = {r.rel: _max([x.weight_scale_2 for x in group.raw]) for r in group.raw}
        for r in group.raw:
            lin = by_module.get(r.rel)
            if lin is None:
                continue
            lin.tensor = NVFP4Tensor(weight=r.weight, weight_scale=r.weight_scale, weight_scale_2=scale_2[r.rel])
            if lin.materialized:
                lin.drop_materialized()
                lin.materialize()
    return len(new)


def _by_expert(raw: list[RawNvfp4]) -> dict[int, dict[str, RawNvfp4]]:
    by_expert: dict[int, dict[str, RawNvfp4]] = {}
    for r in raw:
        e, proj = r.expert_and_proj
        by_expert.setdefault(e, {})[proj] = r
    return by_expert


def _expert_weight_scales_2(raw: list[RawNvfp4]) -> dict[str, torch.Tensor]:
    """up_proj takes gate_proj's weight_scale_2 (SGLang keeps `w13_weight_scale_2[:, 0]`)."""
    scale_2: dict[str, torch.Tensor] = {}
    for projs in _by_expert(raw).values():
        gate = projs.get("gate_proj")
        for proj, r in projs.items():
            scale_2[r.rel] = gate.weight_scale_2 if proj == "up_proj" and gate is not None else r.weight_scale_2
    return scale_2
