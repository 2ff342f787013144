"""Weight check: every NVFP4 expert matrix against the exact INT4 values it came from.

The NVFP4 values are dequantized the way SGLang serves them: up_proj with gate_proj's
`weight_scale_2` (`w13_weight_scale_2[:, 0]`, modelopt_quant.py
`ModelOptNvFp4FusedMoEMethod.process_weights_after_loading`), so a gate/up scale mismatch shows up
as error here, not just as a structural finding.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch
from pydantic import BaseModel, ConfigDict

from ..checkpoint.layout import PROJS
from ..checkpoint.reader import CheckpointReader
from ..distributed import RankContext
from ..errors import CheckpointError
from ..model.layer_weights import LayerWeights, MLPWeights, MoEWeights
from ..model.linear import Int4Linear, NVFP4Linear
from ..numerics.methods import Int4Matrix, MatrixErrorStats
from ..numerics.methods.stats import error_sums, stats_from_sums
from ..numerics.nvfp4 import NVFP4Tensor
from ..numerics.triton_support import triton_module

WORST_MATRICES = 10
# On CUDA the loaded-layer check runs the fused kernel (numerics/compare_kernel.py); False: `error_sums` per matrix.
USE_FUSED_WEIGHT_CHECK = True
MAX_FLAGGED = 50


class MatrixComparison(BaseModel):
    model_config = ConfigDict(extra="forbid", ser_json_inf_nan="constants")

    module: str
    layer: int
    expert: int
    proj: str
    rel_mse: float
    exact_fraction: float
    max_abs_error: float
    numel: int


class LayerWeightError(BaseModel):
    model_config = ConfigDict(extra="forbid", ser_json_inf_nan="constants")

    layer: int
    matrices: int
    rel_mse: float  # pooled over the layer's matrices
    rel_mse_max: float
    exact_fraction: float


class WeightSummary(BaseModel):
    model_config = ConfigDict(extra="forbid", ser_json_inf_nan="constants")

    matrices: int
    rel_mse: float  # pooled over every matrix
    rel_mse_mean: float  # mean of the per-matrix values
    rel_mse_max: float
    exact_fraction: float  # over every element
    layers: list[LayerWeightError]
    worst: list[MatrixComparison]
    flagged: list[str]  # matrices above the rel-MSE gate (first MAX_FLAGGED)
    flagged_count: int
    unreadable: list[str]  # matrices that could not be compared (and why)


@dataclass
class PendingComparison:
    """One matrix's error sums still on the compute device (`stats.error_sums`): a layer's comparisons are read
    back together, in one transfer, instead of one device synchronisation per matrix (1,152 per K2.6 layer)."""

    module: str
    layer: int
    expert: int
    proj: str
    numel: int
    sums: torch.Tensor | None = None  # float64 [4] on the device (`error_sums`)
    partial: torch.Tensor | None = None  # or the fused kernel's per-program partial sums (`compare_kernel`)


def _check_nvfp4_shape(module: str, q: NVFP4Tensor, n_out: int, n_in: int, where: str) -> None:
    if tuple(q.weight.shape) != (n_out, n_in // 2):
        raise CheckpointError(
            f"NVFP4 weight is {list(q.weight.shape)}, expected {[n_out, n_in // 2]}", file=where, tensor=f"{module}.weight"
        )


def _comparison(module: str, layer: int, expert: int, proj: str, m: Int4Matrix, q: NVFP4Tensor, where: str):
    _check_nvfp4_shape(module, q, *m.codes.shape, where)
    return PendingComparison(module, layer, expert, proj, m.codes.numel(), error_sums(m, q))


def _fused_comparison(kernel, module: str, layer: int, expert: int, proj: str, src: Int4Linear, q: NVFP4Tensor,
                      where: str) -> PendingComparison:
    n_out, n_in = src.out_features, src.in_features
    _check_nvfp4_shape(module, q, n_out, n_in, where)
    partial = kernel.compare_partials(src.weight_packed, src.weight_scale, q.weight, q.weight_scale, q.weight_scale_2)
    return PendingComparison(module, layer, expert, proj, n_out * n_in, partial=partial)


def resolve_comparisons(
    found: dict[int, list[PendingComparison] | str],
) -> dict[int, list[tuple[MatrixComparison, MatrixErrorStats]] | str]:
    """Read every pending comparison back at once (one device synchronisation) and build the results."""
    pending = [p for v in found.values() if not isinstance(v, str) for p in v]
    if not pending:
        return dict(found)
    fused = [p.partial for p in pending if p.partial is not None]
    fused_sums = iter(triton_module("compare_kernel").reduce_partials(fused)) if fused else iter(())
    device = (fused[0] if fused else pending[0].sums).device
    sums = torch.stack([next(fused_sums) if p.partial is not None else p.sums.to(device) for p in pending])
    values = iter(sums.cpu().tolist())
    out: dict[int, list[tuple[MatrixComparison, MatrixErrorStats]] | str] = {}
    for e, v in found.items():
        if isinstance(v, str):
            out[e] = v
            continue
        pairs = []
        for p in v:
            s = stats_from_sums(next(values), p.numel)
            comp = MatrixComparison(
                module=p.module, layer=p.layer, expert=p.expert, proj=p.proj, rel_mse=s.rel_mse,
                exact_fraction=s.exact_fraction, max_abs_error=s.max_abs_error, numel=s.numel,
            )
            pairs.append((comp, s))
        out[e] = pairs
    return out


def compare_expert(
    source: CheckpointReader, output: CheckpointReader, layer: int, expert: int, device: torch.device
) -> list[PendingComparison]:
    """The three matrices of one expert: INT4 source values vs NVFP4 values as served (`resolve_comparisons`
    reads them back)."""
    layout = source.layout
    gate_scale_2 = None
    out = []
    for proj in PROJS:
        module = layout.expert_module(layer, expert, proj)
        n_out, n_in = (int(v) for v in source.load(f"{module}.weight_shape").tolist())
        m = Int4Matrix.from_packed(
            source.load(f"{module}.weight_packed").to(device), source.load(f"{module}.weight_scale").to(device), n_in
        )
        scale_2 = output.load(f"{module}.weight_scale_2").to(device=device, dtype=torch.float32).reshape(())
        if proj == "gate_proj":
            gate_scale_2 = scale_2
        elif proj == "up_proj" and gate_scale_2 is not None:
            scale_2 = gate_scale_2
        q = NVFP4Tensor(
            weight=output.load(f"{module}.weight").to(device),
            weight_scale=output.load(f"{module}.weight_scale").to(device),
            weight_scale_2=scale_2,
        )
        out.append(_comparison(module, layer, expert, proj, m, q, str(output.root)))
    return out


def compare_loaded_expert(
    layer: int, expert: int, int4: MLPWeights, nvfp4: MLPWeights, module_of, where: str
) -> list[PendingComparison]:
    """`compare_expert` over an expert both streams already loaded (no second read of either checkpoint)."""
    out = []
    gate_scale_2 = None
    for proj in PROJS:
        src, dst = getattr(int4, proj), getattr(nvfp4, proj)
        if not isinstance(src, Int4Linear) or not isinstance(dst, NVFP4Linear):
            raise CheckpointError(f"expected an INT4 source and an NVFP4 output linear, got {src} and {dst}",
                                  file=where, tensor=module_of(proj))
        scale_2 = dst.tensor.weight_scale_2.to(dtype=torch.float32).reshape(())
        if proj == "gate_proj":
            gate_scale_2 = scale_2
        elif proj == "up_proj" and gate_scale_2 is not None:
            scale_2 = gate_scale_2  # served with gate's (see the module docstring)
        q = NVFP4Tensor(weight=dst.tensor.weight, weight_scale=dst.tensor.weight_scale, weight_scale_2=scale_2)
        kernel = triton_module("compare_kernel") if src.weight_packed.is_cuda and USE_FUSED_WEIGHT_CHECK else None
        if kernel is not None and kernel.int4_whole_groups(src.weight_packed, src.in_features):
            out.append(_fused_comparison(kernel, module_of(proj), layer, expert, proj, src, q, where))
            continue
        m = Int4Matrix.from_packed(src.weight_packed, src.weight_scale, src.in_features)
        out.append(_comparison(module_of(proj), layer, expert, proj, m, q, where))
    return out


class WeightComparer:
    """Accumulates per-layer comparisons into a `WeightSummary` (keeps only the worst matrices)."""

    def __init__(self, source: CheckpointReader, output: CheckpointReader, device: torch.device, flag_rel_mse: float):
        self.source, self.output, self.device = source, output, device
        self.flag_rel_mse = flag_rel_mse
        self._flagged: list[str] = []
        self._flagged_count = 0
        self._all: list[MatrixErrorStats] = []
        self._rel_sum = 0.0
        self._rel_max = 0.0
        self._layers: list[LayerWeightError] = []
        self._worst: list[tuple[float, str, MatrixComparison]] = []
        self._unreadable: list[str] = []

    def add_layer(self, layer: int) -> None:
        """Compare layer `layer`'s experts, reading both checkpoints."""
        self._add(layer, lambda e: compare_expert(self.source, self.output, layer, e, self.device))

    def add_loaded_layer(
        self, layer: int, int4: LayerWeights, nvfp4: LayerWeights | None, ctx: RankContext | None = None
    ) -> None:
        """Compare layer `layer`'s experts from the layers the streams loaded (`nvfp4` None: it did not
        load). Under data parallelism (`ctx`) each rank compares every world_size-th expert and all
        ranks then take every result, in expert order: the same summary as one process."""
        layout, where = self.source.layout, str(self.output.root)

        def one(e: int):
            if nvfp4 is None or not isinstance(nvfp4.mlp, MoEWeights) or not isinstance(int4.mlp, MoEWeights):
                raise CheckpointError(f"layer {layer} did not load as a MoE layer", file=where)
            return compare_loaded_expert(
                layer, e, int4.mlp.experts[e], nvfp4.mlp.experts[e],
                lambda proj: layout.expert_module(layer, e, proj), where,
            )

        self._add(layer, one, ctx or RankContext())

    def _add(self, layer: int, compare, ctx: RankContext = RankContext()) -> None:
        stats: list[MatrixErrorStats] = []
        rel_max = 0.0
        found: dict[int, list | str] = {}
        for e in range(ctx.rank, self.source.layout.text.n_routed_experts, ctx.world_size):
            try:
                found[e] = compare(e)
            except (CheckpointError, ValueError, RuntimeError, IndexError) as err:
                found[e] = str(err)
        found = resolve_comparisons(found)
        if ctx.distributed:
            found = {e: v for part in ctx.all_gather_object(found) for e, v in part.items()}
        for e in sorted(found):
            pairs = found[e]
            if isinstance(pairs, str):
                self._unreadable.append(f"layer {layer} expert {e}: {pairs}")
                continue
            for comp, s in pairs:
                stats.append(s)
                rel_max = max(rel_max, comp.rel_mse)
                self._rel_sum += comp.rel_mse
                if not comp.rel_mse <= self.flag_rel_mse:
                    self._flagged_count += 1
                    if len(self._flagged) < MAX_FLAGGED:
                        self._flagged.append(comp.module)
                item = (comp.rel_mse, comp.module, comp)
                if len(self._worst) < WORST_MATRICES:
                    heapq.heappush(self._worst, item)
                else:
                    heapq.heappushpop(self._worst, item)
        if stats:
            pooled = MatrixErrorStats.pooled(stats)
            self._layers.append(
                LayerWeightError(
                    layer=layer,
                    matrices=len(stats),
                    rel_mse=pooled.rel_mse,
                    rel_mse_max=rel_max,
                    exact_fraction=pooled.exact_fraction,
                )
            )
            self._all.append(pooled)
            self._rel_max = max(self._rel_max, rel_max)

    def summary(self) -> WeightSummary:
        pooled = MatrixErrorStats.pooled(self._all) if self._all else None
        n = sum(l.matrices for l in self._layers)
        return WeightSummary(
            matrices=n,
            rel_mse=pooled.rel_mse if pooled else 0.0,
            rel_mse_mean=self._rel_sum / n if n else 0.0,
            rel_mse_max=self._rel_max,
            exact_fraction=pooled.exact_fraction if pooled else 0.0,
            layers=self._layers,
            worst=[c for _, _, c in sorted(self._worst, key=lambda t: (-t[0], t[1]))],
            flagged=self._flagged,
            flagged_count=self._flagged_count,
            unreadable=self._unreadable[:20],
        )
