"""The routed experts as SGLang's W4A4 path would serve them, with the weights held fixed or transformed (issue 16).

What limits W4A4 accuracy once the weights are as good as they get? These pieces build a reference-model source
(`FloorWeights`) whose routed experts

- keep weights chosen by a `WeightRule`: the exact INT4 values (`exact`: no weight error at all, so what remains
  is the activation quantization alone), or the transformed dense weights quantized to NVFP4 with the BF16-source
  MSE block rule (`mse`, `numerics/bf16_source.py`: the weights of a transformed model are no longer INT4, so the
  INT4-aware search does not apply; the untransformed row uses the same rule for a like-for-like comparison);
- quantize their inputs as SGLang's flashinfer MoE does: one static input scale per layer for gate/up and one for
  down, NVFP4 blocks of 16 with E4M3 block scales (`fake_quantize_activation_nvfp4`, the validate emulation), on
  the inputs named in `quantized` (gate/up, down, or both);
- optionally see their gate/up input through an `InputTransform` that a served checkpoint can carry without any
  kernel change, exact for every BF16 module that reads the same input:
  * `smooth-pow2`: a per-channel power-of-two factor s folded into `post_attention_layernorm` (x -> x / s) and
    into every reader of its output (router, shared experts, routed experts: W -> W diag(s)). Powers of two make
    the BF16 folds exact, so only the NVFP4 experts change. s_j = 2^round(log2(r_j^a / w_j^(1-a))), normalised
    by the geometric mean, with r_j the calibration RMS of input channel j (the layer's every-token statistics)
    and w_j the largest |weight| of column j over the layer's gate/up matrices (SmoothQuant's rule, `alpha` a).
  * `hadamard`: a block-diagonal Hadamard rotation with random signs applied to the whole residual stream
    (QuaRot-style: norm weights folded into their readers, every reader W -> W R^T, every writer W -> R W), of
    which the experts see x -> R x and W -> W R^T. Blocks of 16 match NVFP4's activation blocks. The BF16 folds
    are exact in real arithmetic but not in BF16, so this row is an upper bound for the rotation.

Static input scales come from a calibration pass over the calibration sequences with the row's own weights and
no activation quantization (`calibrate_floor_scales`, as Model Optimizer calibrates): the per-layer maximum of each
(transformed) input, / (6 * 448).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum

import torch

from kimi_nvfp4.model.linear import Linear
from kimi_nvfp4.model.weights import Int4SourceWeights
from kimi_nvfp4.numerics.bf16_source import Bf16ScaleRule, quantize_bf16_group
from kimi_nvfp4.numerics.constants import NVFP4_BLOCK_SIZE
from kimi_nvfp4.numerics.nvfp4 import dequantize_nvfp4, fake_quantize_activation_nvfp4, tensor_scale_from_amax

GATE_UP = "gate_up"
DOWN = "down"
INPUTS = (GATE_UP, DOWN)
HADAMARD_SIGN_SEED = 0


class WeightRule(str, Enum):
    EXACT = "exact"  # the INT4 values (transformed in real arithmetic): no weight error
    MSE = "mse"  # the (transformed) dense weights through the BF16-source MSE block rule


class TransformKind(str, Enum):
    NONE = "none"
    SMOOTH_POW2 = "smooth-pow2"
    HADAMARD = "hadamard"


@dataclass(frozen=True)
class InputTransform:
    """How the experts' gate/up input is re-expressed (module docstring)."""

    kind: TransformKind = TransformKind.NONE
    alpha: float = 0.5  # smooth-pow2: SmoothQuant's migration strength
    block: int = NVFP4_BLOCK_SIZE  # hadamard: rotation block (a power of two dividing the hidden size)

    @property
    def label(self) -> str:
        if self.kind is TransformKind.SMOOTH_POW2:
            return f"smooth-pow2 (alpha {self.alpha:g})"
        if self.kind is TransformKind.HADAMARD:
            return f"hadamard {self.block}"
        return "none"


def hadamard_matrix(n: int) -> torch.Tensor:
    """Sylvester's orthonormal Hadamard matrix of order n (a power of two), float64."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"Hadamard order {n} is not a power of two")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(n)


def block_rotation(width: int, block: int, seed: int) -> torch.Tensor:
    """R = blockdiag(H_block) diag(signs), float64 `[width, width]`, orthogonal; random signs from `seed`."""
    if width % block:
        raise ValueError(f"rotation block {block} does not divide the width {width}")
    signs = torch.randint(0, 2, (width,), generator=torch.Generator().manual_seed(seed)).double() * 2 - 1
    return torch.block_diag(*([hadamard_matrix(block)] * (width // block))) * signs


def power_of_two(values: torch.Tensor) -> torch.Tensor:
    return torch.exp2(torch.round(torch.log2(values)))


def smoothing_factors(channel_rms: torch.Tensor, column_max: torch.Tensor, alpha: float) -> torch.Tensor:
    """s (float64, powers of two): SmoothQuant's r^a / w^(1-a), normalised by its geometric mean, rounded in log2."""
    raw = channel_rms.double().clamp_min(1e-30) ** alpha / column_max.double().clamp_min(1e-30) ** (1.0 - alpha)
    return power_of_two(raw / raw.log().mean().exp())


class LayerInput:
    """One layer's (gate/up or down) expert input: its transform, static scale, and calibration maximum.

    Every linear of the input shares this object's `token` as its `input_quantizer()`, so the MoE quantizes a
    chunk once for all experts (model/moe.py `shared_input_quantizer`), as SGLang does with its layer scale.
    """

    def __init__(self, transform: torch.Tensor | None, transform_is_rotation: bool, quantize: bool):
        self.transform = transform  # smoothing: divide by it; rotation: x @ R^T
        self.rotation = transform_is_rotation
        self.quantize = quantize
        self.scale: torch.Tensor | None = None
        self.amax = torch.zeros((), dtype=torch.float32)
        self.token = torch.ones(())

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        if self.transform is None:
            xt = x.float()
        elif self.rotation:
            xt = x.float() @ self.transform.T.to(torch.float32)
        else:
            xt = x.float() / self.transform.to(torch.float32)
        if self.scale is None:  # calibration pass: record, do not quantize
            if xt.numel():
                self.amax = torch.maximum(self.amax, xt.abs().amax())
            return xt.to(x.dtype)
        if not self.quantize or xt.shape[0] == 0:
            return xt.to(x.dtype)
        return fake_quantize_activation_nvfp4(xt, self.scale).to(x.dtype)

    def freeze(self) -> None:
        self.scale = tensor_scale_from_amax(self.amax.clamp_min(torch.finfo(torch.float32).tiny))


class FloorLinear(Linear):
    """An expert linear with a fixed dense weight (already in the transformed basis) reading `state`'s input."""

    def __init__(self, module: str, weight: torch.Tensor, state: LayerInput, dtype: torch.dtype):
        super().__init__(module, weight.shape[0], weight.shape[1], dtype)
        self._weight = weight.to(dtype)
        self.state = state

    def _dequantize(self) -> torch.Tensor:
        return self._weight

    def stored_bytes(self) -> int:
        return self._weight.numel() * self._weight.element_size()

    def input_quantizer(self) -> torch.Tensor:
        return self.state.token

    def quantize_input(self, x: torch.Tensor) -> torch.Tensor:
        return self.state.apply(x)


class FloorWeights(Int4SourceWeights):
    """The INT4 source with its routed experts replaced as the module docstring says (everything else exact).

    :param stats: `{layer: LayerExpertStats}` from calibrate's expert statistics (smooth-pow2 reads the layer's
        every-token gate/up channel energies); unused by the other transforms.
    """

    def __init__(self, reader, *, rule: WeightRule, transform: InputTransform, quantized: Iterable[str],
                 stats: dict | None = None):
        super().__init__(reader)
        self.rule = WeightRule(rule)
        self.input_transform = transform
        self.quantized = frozenset(quantized)
        unknown = self.quantized - set(INPUTS)
        if unknown:
            raise ValueError(f"unknown expert inputs {sorted(unknown)} (known: {INPUTS})")
        self.stats = stats or {}
        self.inputs: dict[tuple[int, str], LayerInput] = {}

    def freeze_scales(self) -> None:
        """End of the calibration pass: every layer input's static scale from its recorded maximum."""
        for state in self.inputs.values():
            state.freeze()

    def _gate_up_transform(self, layer: int, experts) -> tuple[torch.Tensor | None, bool]:
        t = self.input_transform
        if t.kind is TransformKind.NONE:
            return None, False
        width = experts[0].gate_proj.in_features
        if t.kind is TransformKind.HADAMARD:
            return block_rotation(width, t.block, HADAMARD_SIGN_SEED + layer), True
        shared = self.stats[layer].shared.get(GATE_UP) if layer in self.stats else None
        if shared is None:
            raise ValueError(f"layer {layer}: smooth-pow2 needs the layer's shared gate/up statistics")
        column_max = torch.stack([
            torch.cat([e.gate_proj.weight(), e.up_proj.weight()]).abs().amax(0) for e in experts
        ]).amax(0)
        return smoothing_factors(shared.channel_energy.sqrt(), column_max, t.alpha), False

    def layer(self, i, device="cpu", dtype=torch.float32):
        lw = super().layer(i, device, dtype)
        if not lw.is_moe:
            return lw
        experts = lw.mlp.experts
        if (i, GATE_UP) not in self.inputs:  # made on first load; its transform and scales serve every reload
            transform, rotation = self._gate_up_transform(i, experts)
            self.inputs[(i, GATE_UP)] = LayerInput(transform, rotation, GATE_UP in self.quantized)
            self.inputs[(i, DOWN)] = LayerInput(None, False, DOWN in self.quantized)
        gate_up, down = self.inputs[(i, GATE_UP)], self.inputs[(i, DOWN)]
        transform = gate_up.transform
        for e in experts:
            g, u, d = (lin.weight().double() for lin in (e.gate_proj, e.up_proj, e.down_proj))
            if transform is not None:
                g, u = (w @ transform.T if gate_up.rotation else w * transform for w in (g, u))
            if self.rule is WeightRule.MSE:  # gate and up share one weight_scale_2, as SGLang's w13 needs
                g, u = (dequantize_nvfp4(q) for q in quantize_bf16_group([g, u], Bf16ScaleRule.MSE))
                d = dequantize_nvfp4(quantize_bf16_group([d], Bf16ScaleRule.MSE)[0])
            e.gate_proj = FloorLinear(e.gate_proj.module, g, gate_up, dtype)
            e.up_proj = FloorLinear(e.up_proj.module, u, gate_up, dtype)
            e.down_proj = FloorLinear(e.down_proj.module, d, down, dtype)
        return lw


def calibrate_floor_scales(weights: FloorWeights, sequences, runner_factory) -> None:
    """The calibration pass: run `sequences` through `runner_factory(weights)`, then fix every input's scale."""
    if any(state.scale is not None for state in weights.inputs.values()):
        raise ValueError("the scales are already calibrated")
    for _ in runner_factory(weights).run(sequences):
        pass
    weights.freeze_scales()


__all__ = [
    "DOWN",
    "GATE_UP",
    "INPUTS",
    "FloorLinear",
    "FloorWeights",
    "InputTransform",
    "LayerInput",
    "TransformKind",
    "WeightRule",
    "block_rotation",
    "calibrate_floor_scales",
    "hadamard_matrix",
    "smoothing_factors",
]
