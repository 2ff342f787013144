"""Per-expert input statistics for the output-aware scale methods (`calibrate --expert-stats diag|hessian`).

An expert's gate_proj and up_proj read the same rows (its routed tokens' hidden states); its down_proj reads its
own intermediate. `ExpertStatsObserver` accumulates, per routed expert and per input (`gate_up`, `down`), the
running sums `InputStatsAccumulator` keeps: the channel energies always, and with `hessian` the dense `X^T X`
and the fourth moments the Hessian shrinkage needs. The layer's shared statistics of the gate/up input (every
token's MoE input, read where the shared expert's gate_proj sees it) are kept too: the fallback for experts that
saw too few tokens (`numerics/methods/output_aware/refine.py`). There is no shared fallback for down: each
expert's intermediate space is its own.

`w4a4` (for `gptq-w4a4` and `gptq-w4a4-diag`) records what the served layer reads instead: in calibrate's W4A4
"advance" pass, where the layer's static input scales have just been chosen and the experts quantize their inputs,
each routed expert input x and its fake-quantized twin x~ = `linear.quantize_input(x)` (the emulation's own
function, the bits the advance pass multiplies by): E[x x^T], E[x~ x~^T] and E[x x~^T] (and their diagonals). x is
the input the served expert receives before its activation quantizer; the INT4 layer's output on that same x is the
target, so the statistics describe this linear's own error, not what earlier layers already changed. gate/up's x
equals the observe pass's (same hidden states, same BF16 router); down's x is the intermediate of the W4A4 gate/up,
the one the served down_proj quantizes. The shared gate/up fallback is quantized with the routed experts' gate/up
quantizer when the layer shares one (SGLang's layer-max reduction), else it is not recorded. See `arm`.

Only routed tokens count (what the served model sends an expert); `route-all` statistics passes are ignored.
The observer lives beside calibrate's `ActivationCollector` for one layer at a time (`start_layer` drops the
previous layer's sums), so memory is one layer's accumulators: with `hessian`, n_experts x (hidden^2 +
intermediate^2) sums (K2.6: 384 x (7168^2 + 2048^2) float32 = 85 GB on the device; float64 on the CPU).
"""

from __future__ import annotations

from enum import Enum

import torch

from ..model.layer_weights import LayerWeights
from ..model.linear import Linear
from ..model.moe import shared_input_quantizer
from ..numerics.methods import InputStatsAccumulator, StatisticsNeed, method_spec

GATE_UP, DOWN = "gate_up", "down"
# gate_proj and up_proj read the same rows: the statistics are taken once, at gate_proj
_STATS_INPUT = {"gate_proj": GATE_UP, "down_proj": DOWN}
# The module that reads every token's MoE input (the shared expert): the layer's shared gate/up statistics.
SHARED_INPUT_MODULE = "mlp.shared_experts.gate_proj"
_EXPERT_PREFIX = "mlp.experts."


class ExpertStatsMode(str, Enum):
    """What calibrate records per routed expert input."""

    NONE = "none"  # nothing (calibrate's outputs as before)
    DIAG = "diag"  # channel energies E[x_j^2] (act-diag)
    HESSIAN = "hessian"  # also the dense X^T X / n where an expert saw enough tokens (gptq)
    # the served (W4A4) inputs, from the advance pass: dense E[x x^T], E[x~ x~^T], E[x x~^T] (gptq-w4a4*)
    W4A4 = "w4a4"

    @property
    def dense(self) -> bool:
        return self in (ExpertStatsMode.HESSIAN, ExpertStatsMode.W4A4)

    @property
    def quantized(self) -> bool:
        """Statistics of the quantized inputs, taken in the W4A4 pass (after the layer's scales are chosen)."""
        return self is ExpertStatsMode.W4A4


# The `--expert-stats` each kind of statistics a scale method needs is served by: a dense Hessian also carries the
# diagonal.
STATS_MODES_FOR = {
    StatisticsNeed.DIAGONAL: (ExpertStatsMode.DIAG, ExpertStatsMode.HESSIAN),
    StatisticsNeed.HESSIAN: (ExpertStatsMode.HESSIAN,),
    # the served inputs' moments come from calibrate's W4A4 pass; the other methods' statistics are the W4A16
    # observe pass's, so neither kind stands in for the other
    StatisticsNeed.W4A4_HESSIAN: (ExpertStatsMode.W4A4,),
}


def expert_stats_mode_for(method: str) -> ExpertStatsMode:
    """What calibrate must record for the output-aware scale method `method` (the least that suffices)."""
    need = method_spec(str(getattr(method, "value", method))).statistics
    if need is StatisticsNeed.NONE:
        raise ValueError(f"scale method {method!r} needs no calibration statistics: convert runs it")
    return STATS_MODES_FOR[need][0]


def _sum_dtype(device: torch.device) -> torch.dtype:
    # float64 where it is cheap (CPU, the reference); float32 halves the dense sums' memory on a GPU
    return torch.float64 if device.type == "cpu" else torch.float32


class ExpertStatsObserver:
    """A `kimi_nvfp4.model` observer recording each routed expert's input statistics for one layer at a time."""

    needs_outputs = False
    route_all = False  # never asks for statistics-only passes itself (calibrate's collector may)

    def __init__(self, mode: ExpertStatsMode, device: torch.device | str = "cpu"):
        if mode is ExpertStatsMode.NONE:
            raise ValueError("ExpertStatsObserver needs mode diag or hessian")
        self.mode = mode
        self.device = torch.device(device)
        self.layer: int | None = None
        self.experts: dict[tuple[int, str], InputStatsAccumulator] = {}
        self.shared: InputStatsAccumulator | None = None
        # w4a4 mode: the layer's linears by module name, and the routed gate/up quantizer for the shared input;
        # None until `arm` (the observe pass before it is not what the served layer reads)
        self._linears: dict[str, Linear] | None = None
        self._shared_quantizer: Linear | None = None
        # Expert groups (calibrate --method, when one layer's dense sums do not fit at once): only experts in
        # [lo, hi) are recorded; the MoE skips the others in statistics-only passes (model/moe.py). The shared
        # input is recorded in the layer's first pass only (`record_shared`).
        self.expert_range: tuple[int, int] | None = None
        self.record_shared = True

    @property
    def dense(self) -> bool:
        return self.mode.dense

    def start_layer(self, layer: int) -> None:
        self.layer = layer
        self.experts = {}
        self.shared = None
        self._linears = None
        self._shared_quantizer = None
        self.expert_range = None
        self.record_shared = True

    def start_group(self, lo: int, hi: int, *, first: bool) -> None:
        """Record experts [lo, hi) of the current layer from now on (the previous group's sums dropped); the
        shared input's statistics are kept from the first group's pass and not recorded again."""
        self.experts = {}
        self.expert_range = (lo, hi)
        self.record_shared = first

    @property
    def experts_only(self) -> bool:
        """A later group's pass: nothing but the routed experts in `expert_range` is wanted (model/moe.py skips
        the shared expert and the other routed experts)."""
        return self.expert_range is not None and not self.record_shared

    def arm(self, weights: LayerWeights) -> None:
        """w4a4 mode: record from now on, quantizing each input as `weights`' linears do (their W4A4 scales set)."""
        self._linears = {lin.module: lin for lin in weights.linears()}
        if weights.is_moe:
            routed = [lin for e in weights.mlp.experts for lin in (e.gate_proj, e.up_proj)]
            self._shared_quantizer = shared_input_quantizer(routed)

    def _accumulator(self, width: int) -> InputStatsAccumulator:
        return InputStatsAccumulator(width, dense=self.dense, device=self.device, dtype=_sum_dtype(self.device),
                                     quantized=self.mode.quantized)

    def _add(self, acc: InputStatsAccumulator, x: torch.Tensor, quantizer: Linear | None) -> None:
        acc.add(x, quantizer.quantize_input(x) if self.mode.quantized else None)

    # --- observer protocol (kimi_nvfp4.model.observer) ---------------------------------------
    def on_linear(self, layer, module, x, y, expert=None, routed=True) -> None:
        if not routed or x is None:
            return
        if layer != self.layer:
            raise RuntimeError(f"expert statistics were set up for layer {self.layer} but saw layer {layer}")
        if self.mode.quantized and self._linears is None:
            return  # the observe pass: the served layer's scales are not chosen yet
        if expert is None:
            if not self.record_shared:
                return
            if module == SHARED_INPUT_MODULE and (not self.mode.quantized or self._shared_quantizer is not None):
                if self.shared is None:
                    self.shared = self._accumulator(x.shape[-1])
                self._add(self.shared, x, self._shared_quantizer)
            return
        group = _STATS_INPUT.get(module.rsplit(".", 1)[-1])
        if group is None or not module.startswith(_EXPERT_PREFIX):
            return
        if self.expert_range is not None and not self.expert_range[0] <= expert < self.expert_range[1]:
            return
        acc = self.experts.get((expert, group))
        if acc is None:
            acc = self.experts[(expert, group)] = self._accumulator(x.shape[-1])
        quantizer = None
        if self.mode.quantized:
            quantizer = self._linears[module]
            if quantizer.input_quantizer() is None:
                raise RuntimeError(f"layer {layer} {module}: w4a4 expert statistics need the W4A4 pass's linears")
        self._add(acc, x, quantizer)

    def on_router(self, layer, topk_ids, topk_weights, n_experts=None) -> None:
        pass

    def combine_ranks(self, ctx, widths: dict[str, int], n_experts: int) -> None:
        """Every rank's sums become those of all ranks' tokens (data parallelism): sums and counts by sum, in a
        fixed key order (every expert and input of the layer, created empty where a rank saw none)."""
        if not ctx.distributed:
            return
        lo, hi = self.expert_range or (0, n_experts)
        for e in range(lo, hi):
            for group, width in widths.items():
                if (e, group) not in self.experts:
                    self.experts[(e, group)] = self._accumulator(width)
        shared = []
        if self.record_shared:  # a later group's pass: the shared sums were combined with the first group's
            if self.shared is None:
                self.shared = self._accumulator(widths[GATE_UP])
            shared = [self.shared]
        for acc in [self.experts[k] for k in sorted(self.experts)] + shared:
            for total in acc.sums():
                ctx.all_reduce_sum_(total)
            tokens = torch.tensor([acc.tokens], dtype=torch.int64, device=acc.sum_squares.device)
            acc.tokens = int(ctx.all_reduce_sum_(tokens)[0])


class CollectorWithExpertStats:
    """calibrate's `ActivationCollector` and an `ExpertStatsObserver` seen by the runner as one observer: the
    collector decides `route_all`, both see every linear."""

    needs_outputs = False

    def __init__(self, collector, experts: ExpertStatsObserver):
        self.collector, self.experts = collector, experts

    @property
    def route_all(self) -> bool:
        return self.collector.route_all

    def on_linear(self, layer, module, x, y, expert=None, routed=True) -> None:
        self.collector.on_linear(layer, module, x, y, expert=expert, routed=routed)
        self.experts.on_linear(layer, module, x, y, expert=expert, routed=routed)

    def on_expert_rows(self, layer, rows, spans, modules, n_experts) -> None:
        self.collector.on_expert_rows(layer, rows, spans, modules, n_experts)
        for (e, a, b), names in zip(spans, modules):
            for name in names:
                self.experts.on_linear(layer, name, rows[a:b], None, expert=e)

    def on_router(self, layer, topk_ids, topk_weights, n_experts=None) -> None:
        self.collector.on_router(layer, topk_ids, topk_weights, n_experts)
