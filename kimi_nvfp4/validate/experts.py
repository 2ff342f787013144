"""Per-expert output error: each routed expert of the INT4 stream re-run with its NVFP4 weights
on exactly the tokens the router sent it, for every emulation mode.

`ExpertErrorObserver` watches the INT4 stream's layer: at an expert's `gate_proj` call it keeps
the expert input `x` (only its routed tokens); at the matching `down_proj` call it has the INT4
expert output and runs the NVFP4 expert (`down(silu(gate(x)) * up(x))`, activations fake-quantized
for W4A4, untouched for W4A16) on the same `x`. Holds one NVFP4 layer (compressed) besides the
INT4 layer the runner holds.

`max_tokens` caps the tokens compared per expert and layer (validate's `--expert-check-tokens`): the first
ones the router sends it, in stream order. The check re-runs every expert once per mode on top of the streams,
so at K2.6 scale (512 x 2048 tokens: ~22k tokens per expert per layer on average) comparing all of them costs two
more full MoE passes per layer, and while the INT4 stream runs the NVFP4 layer is not dequantized yet (both
would not fit beside the states), so each call dequantizes the expert's three matrices. With 1,024 tokens an
expert's budget is mostly filled within the first 65,536-token chunk (K2.6 routes ~1,365 tokens per expert per
chunk), so most experts are dequantized once per layer; a relative MSE over 1,024 tokens x 7,168 outputs is a
7M-element estimate, against gates 2-6x above the measured worst expert. Under data parallelism each rank compares its own first tokens (the cap applies per rank), so the
figures depend on the number of ranks within that sampling.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict

from ..model.batch_invariant import linear_rows, pointwise_rows
from ..model.layer_weights import LayerWeights, MLPWeights, MoEWeights
from ..model.linear import ActivationMode
from .metrics import RelativeError

WORST_EXPERTS = 10
# Tokens compared per expert and layer by default (see the module docstring); 0 or None compares all.
DEFAULT_EXPERT_CHECK_TOKENS = 1024


class ExpertError(BaseModel):
    model_config = ConfigDict(extra="forbid", ser_json_inf_nan="constants")

    layer: int
    expert: int
    mode: str
    rel_mse: float
    tokens: int


def _swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def nvfp4_expert_output(w: MLPWeights, x: torch.Tensor, mode: ActivationMode,
                        weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """The NVFP4 expert as the served kernels compute it in `mode` (W4A16: no activation quantization).
    `weights`: the three dequantized matrices, when the caller has them (one dequantization for every mode)."""
    gate_w, up_w, down_w = weights or (w.gate_proj.weight(), w.up_proj.weight(), w.down_proj.weight())
    if mode is not ActivationMode.W4A4:
        return linear_rows(pointwise_rows(_swiglu, linear_rows(x, gate_w), linear_rows(x, up_w)), down_w)
    xq = w.gate_proj.quantize_input(x)
    # one quantization for gate and up when they share the scale, as the w13 GEMM does
    xq_up = xq if w.up_proj.input_quantizer() is w.gate_proj.input_quantizer() else w.up_proj.quantize_input(x)
    h = pointwise_rows(_swiglu, linear_rows(xq, gate_w), linear_rows(xq_up, up_w))
    return linear_rows(w.down_proj.quantize_input(h), down_w)


class ExpertErrorObserver:
    """Observer for the INT4 stream; compares every routed expert's output with NVFP4's."""

    route_all = False

    def __init__(
        self, layer: int, nvfp4_layer: LayerWeights, modes: list[ActivationMode], max_tokens: int | None = None
    ):
        if not isinstance(nvfp4_layer.mlp, MoEWeights):
            raise ValueError(f"layer {layer} is not a MoE layer")
        self.layer = layer
        self.experts = nvfp4_layer.mlp.experts
        self.modes = modes
        self.max_tokens = max_tokens or None
        self.errors: dict[tuple[ActivationMode, int], RelativeError] = {}
        self.tokens: dict[int, int] = {}
        self._pending: dict[int, torch.Tensor] = {}

    def on_router(self, layer, topk_ids, topk_weights) -> None:
        pass

    def on_linear(self, layer, module, x, y, expert=None, routed=True) -> None:
        if expert is None or not routed or layer != self.layer:
            return
        if module.endswith(".gate_proj"):
            if self.max_tokens is not None:
                x = x[: max(0, self.max_tokens - self.tokens.get(expert, 0))]
            self._pending[expert] = x
        elif module.endswith(".down_proj"):
            x_in = self._pending.pop(expert, None)
            if x_in is None:
                raise RuntimeError(f"layer {layer} expert {expert}: down_proj ran before gate_proj was observed")
            if x_in.shape[0] == 0:
                return
            y = y[: x_in.shape[0]]
            self.tokens[expert] = self.tokens.get(expert, 0) + x_in.shape[0]
            nv = self.experts[expert]
            # dequantized once for every mode (the layer is not materialized yet while the INT4 stream runs)
            weights = (nv.gate_proj.weight(), nv.up_proj.weight(), nv.down_proj.weight())
            for mode in self.modes:
                test = nvfp4_expert_output(nv, x_in, mode, weights)
                self.errors.setdefault((mode, expert), RelativeError()).add(y, test)

    def results(self) -> list[ExpertError]:
        return [
            ExpertError(layer=self.layer, expert=e, mode=mode.value, rel_mse=acc.rel_mse, tokens=self.tokens.get(e, 0))
            for (mode, e), acc in sorted(self.errors.items(), key=lambda kv: (kv[0][0].value, kv[0][1]))
        ]
