"""Streaming activation statistics for every linear the reference model runs.

`ActivationStats` accumulates, over any number of token chunks, what calibration needs per linear:
the input amax (what `input_scale` is made from), the per-input-channel sum of squares (kept for
later activation-aware scale methods) and the token count. `ActivationCollector` is the
`kimi_nvfp4.model` observer that feeds one `ActivationStats` per (module, expert), separating the
statistics-only `route-all` passes from the tokens the router really sent.

Everything stays on the device the model runs on until the layer is finished: no per-chunk
host synchronisation. The routed experts' inputs arrive as one expert-sorted buffer per chunk
(`on_expert_rows`, model/moe.py's sorted path): their statistics are taken for all experts at once
(`numerics/segment_stats_kernel.py` on CUDA) into stacked per-layer sums, `ExpertBank`, which become
per-expert `ActivationStats` entries when `routed` is read.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..checkpoint.writer import ShardWriter
from ..numerics.triton_support import triton_module


@dataclass
class ChunkSummary:
    """One chunk's contribution to `ActivationStats`."""

    amax: torch.Tensor  # fp32 0-d
    sum_sq: torch.Tensor  # fp64 [in_features]
    tokens: int


@dataclass
class ActivationStats:
    """Input statistics of one linear, accumulated over token chunks."""

    in_features: int
    device: torch.device | str = "cpu"
    tokens: int = 0
    amax: torch.Tensor | None = None  # fp32 0-d, max |x| seen (zero when not given)
    sum_sq: torch.Tensor | None = None  # fp64 [in_features], sum over tokens of x^2 (zeros when not given)

    def __post_init__(self) -> None:
        if self.amax is None:
            self.amax = torch.zeros((), dtype=torch.float32, device=self.device)
        if self.sum_sq is None:
            self.sum_sq = torch.zeros(self.in_features, dtype=torch.float64, device=self.device)

    def update(self, x: torch.Tensor) -> None:
        """Add a chunk of inputs `[tokens, in_features]` (any leading dims are flattened)."""
        self.add(self.summarize(x))

    def summarize(self, x: torch.Tensor) -> ChunkSummary | None:
        """What `update(x)` adds, computed once (gate_proj and up_proj read the same `x`)."""
        rows = x.reshape(-1, x.shape[-1])
        if rows.shape[-1] != self.in_features:
            raise ValueError(f"expected inputs with {self.in_features} features, got {rows.shape[-1]}")
        if rows.shape[0] == 0:
            return None
        rows = rows.to(device=self.amax.device, dtype=torch.float32)
        # Square in fp32 (exact enough per element), accumulate across chunks in fp64.
        return ChunkSummary(rows.abs().amax(), rows.square().sum(dim=0, dtype=torch.float64), rows.shape[0])

    def add(self, summary: ChunkSummary | None) -> None:
        if summary is None:
            return
        self.amax = torch.maximum(self.amax, summary.amax)
        self.sum_sq += summary.sum_sq
        self.tokens += summary.tokens

    def merge(self, other: "ActivationStats") -> None:
        if other.in_features != self.in_features:
            raise ValueError("cannot merge statistics of linears with different input widths")
        self.amax = torch.maximum(self.amax, other.amax.to(self.amax.device))
        self.sum_sq += other.sum_sq.to(self.sum_sq.device)
        self.tokens += other.tokens

    @property
    def amax_value(self) -> float:
        return float(self.amax)

    def mean_square(self) -> torch.Tensor:
        """Per-input-channel mean of x^2 (fp32 `[in_features]`; zeros when no token was seen)."""
        if self.tokens == 0:
            return torch.zeros(self.in_features, dtype=torch.float32)
        return (self.sum_sq / self.tokens).to(torch.float32).cpu()


StatsKey = tuple[str, int | None]  # (module name without prefix, expert index or None)
ExpertSpan = tuple[int, int, int]  # (expert, first row, end row) in an expert-sorted buffer


def segment_stats_reference(rows: torch.Tensor, bounds: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """`(amax [spans] fp32, sum_sq [spans, width] fp64)` of each row span, by `ActivationStats.summarize`'s
    arithmetic (the CPU path, and what the CUDA kernel is held to)."""
    amax, sums = [], []
    for a, b in bounds:
        part = rows[a:b].to(torch.float32)
        amax.append(part.abs().amax())
        sums.append(part.square().sum(dim=0, dtype=torch.float64))
    return torch.stack(amax), torch.stack(sums)


def segment_stats(rows: torch.Tensor, bounds: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """`segment_stats_reference`'s figures; one fused kernel on CUDA (sums equal up to float64 addition order)."""
    kernel = triton_module("segment_stats_kernel") if rows.is_cuda else None
    if kernel is None:
        return segment_stats_reference(rows, bounds)
    return kernel.segment_stats(rows, bounds)


@dataclass
class ExpertBank:
    """One MoE input (gate/up's, or down's) of every routed expert of a layer, stacked: updated once per chunk
    for all experts, instead of once per expert."""

    amax: torch.Tensor  # fp32 [n_experts]
    sum_sq: torch.Tensor  # fp64 [n_experts, width]
    tokens: list[int]
    modules: dict[int, tuple[str, ...]] = field(default_factory=dict)  # expert -> the linears reading these rows

    @classmethod
    def empty(cls, n_experts: int, width: int, device: torch.device | str) -> "ExpertBank":
        return cls(torch.zeros(n_experts, dtype=torch.float32, device=device),
                   torch.zeros(n_experts, width, dtype=torch.float64, device=device), [0] * n_experts)

    def add(self, spans: list[ExpertSpan], modules: list[tuple[str, ...]], amax: torch.Tensor,
            sum_sq: torch.Tensor) -> None:
        experts = [e for e, _, _ in spans]
        index = torch.tensor(experts, dtype=torch.int64).to(self.amax.device)
        # experts are distinct within a chunk: plain indexed updates, no atomics, same bytes every run
        self.amax[index] = torch.maximum(self.amax[index], amax.to(self.amax.device))
        self.sum_sq[index] += sum_sq.to(self.sum_sq.device)
        for (e, a, b), names in zip(spans, modules):
            self.tokens[e] += b - a
            self.modules[e] = names

    def entries(self) -> dict[StatsKey, ActivationStats]:
        """An `ActivationStats` per (linear, expert) that saw tokens; linears reading the same rows get their own
        copies (entries are updated in place later)."""
        out: dict[StatsKey, ActivationStats] = {}
        copies: list[tuple[torch.Tensor, torch.Tensor]] = [(self.amax, self.sum_sq)]
        width = self.sum_sq.shape[1]
        for e, names in sorted(self.modules.items()):
            if not self.tokens[e]:
                continue
            for j, name in enumerate(names):
                while len(copies) <= j:
                    copies.append((self.amax.clone(), self.sum_sq.clone()))
                amax, sum_sq = copies[j]
                out[(name, e)] = ActivationStats(width, device=self.sum_sq.device, tokens=self.tokens[e],
                                                 amax=amax[e], sum_sq=sum_sq[e])
        return out


class ActivationCollector:
    """Observer for `LayerStreamRunner.apply_layer`: records input statistics of every linear.

    `routed` statistics come from the tokens the router actually sent (what the served model sees);
    `route_all` statistics come from the statistics-only pass in which every token also runs
    through every expert (`route_all=True`); they never mix.
    """

    # only inputs are measured: statistics-only passes may skip computing outputs (model/moe.py)
    needs_outputs = False

    def __init__(self, *, route_all: bool = False, device: torch.device | str = "cpu"):
        self.route_all = route_all
        self.device = device
        self.layer: int | None = None
        self._routed: dict[StatsKey, ActivationStats] = {}
        self._banks: dict[tuple[str, ...], ExpertBank] = {}  # routed experts' inputs, by the linears' roles
        self.all_tokens: dict[StatsKey, ActivationStats] = {}
        self.expert_tokens: torch.Tensor | None = None  # int64 [n_experts], router assignments
        self.router_tokens = 0
        # the last input summarized, with its version: gate_proj then up_proj report the same tensor
        self._last: tuple[torch.Tensor, int, ChunkSummary | None] | None = None

    def start_layer(self, layer: int) -> None:
        """Forget the previous layer's statistics (the caller has consumed them)."""
        self.layer = layer
        self._routed = {}
        self._banks = {}
        self.all_tokens = {}
        self.expert_tokens = None
        self.router_tokens = 0
        self._last = None

    @property
    def routed(self) -> dict[StatsKey, ActivationStats]:
        """Statistics of the tokens the router sent, per (linear, expert or None)."""
        for bank in self._banks.values():
            for key, stats in bank.entries().items():
                if key in self._routed:
                    self._routed[key].merge(stats)
                else:
                    self._routed[key] = stats
        self._banks = {}
        return self._routed

    def _check_layer(self, layer: int) -> None:
        if self.layer is None:
            self.layer = layer
        elif layer != self.layer:
            raise RuntimeError(f"observer was set up for layer {self.layer} but saw layer {layer}")

    # --- observer protocol (kimi_nvfp4.model.runner) ---------------------------------------
    def on_linear(
        self,
        layer: int,
        module: str,
        x: torch.Tensor,
        y: torch.Tensor,
        expert: int | None = None,
        routed: bool = True,
    ) -> None:
        self._check_layer(layer)
        table = self._routed if routed else self.all_tokens
        key = (module, expert)
        stats = table.get(key)
        if stats is None:
            stats = table[key] = ActivationStats(x.shape[-1], device=self.device)
        last = self._last
        if last is not None and last[0] is x and last[1] == x._version:
            summary = last[2]  # same tensor, unmodified: same numbers (saves a third of the reductions)
        else:
            summary = stats.summarize(x)
            self._last = (x, x._version, summary)
        stats.add(summary)

    def on_expert_rows(
        self, layer: int, rows: torch.Tensor, spans: list[ExpertSpan], modules: list[tuple[str, ...]], n_experts: int
    ) -> None:
        """The routed experts' inputs of one chunk as one expert-sorted buffer (`ExpertRowsObserver`): expert
        `spans[i][0]` read `rows[spans[i][1]:spans[i][2]]` through the linears `modules[i]`."""
        self._check_layer(layer)
        spans = [s for s in spans if s[2] > s[1]]
        if not spans:
            return
        role = tuple(name.rsplit(".", 1)[-1] for name in modules[0])
        bank = self._banks.get(role)
        if bank is None:
            bank = self._banks[role] = ExpertBank.empty(n_experts, rows.shape[-1], self.device)
        elif bank.sum_sq.shape != (n_experts, rows.shape[-1]):
            raise ValueError(f"expert inputs {role} changed shape within layer {layer}: {tuple(bank.sum_sq.shape)} "
                             f"then {(n_experts, rows.shape[-1])}")
        amax, sum_sq = segment_stats(rows, [(a, b) for _, a, b in spans])
        bank.add(spans, modules, amax, sum_sq)
        self._last = None

    def on_router(
        self, layer: int, topk_ids: torch.Tensor, topk_weights: torch.Tensor, n_experts: int | None = None
    ) -> None:
        self._check_layer(layer)
        ids = topk_ids.reshape(-1).to(device=self.device, dtype=torch.int64)
        size = max(int(n_experts or 0), int(ids.max()) + 1 if ids.numel() else 0)
        counts = torch.bincount(ids, minlength=size)
        if self.expert_tokens is None:
            self.expert_tokens = counts
        else:
            if counts.numel() > self.expert_tokens.numel():
                self.expert_tokens = torch.nn.functional.pad(
                    self.expert_tokens, (0, counts.numel() - self.expert_tokens.numel())
                )
            elif counts.numel() < self.expert_tokens.numel():
                counts = torch.nn.functional.pad(counts, (0, self.expert_tokens.numel() - counts.numel()))
            self.expert_tokens += counts
        self.router_tokens += topk_ids.shape[0]

    def combine_ranks(self, ctx) -> None:
        """Make every rank's statistics those of all ranks' tokens together (data parallelism,
        `kimi_nvfp4.distributed`): maxima by max (exact), sums and counts by sum. Every rank ends
        with the same numbers, so every rank chooses the same scales."""
        if not ctx.distributed:
            return
        for table in (self.routed, self.all_tokens):
            mine = [(m, -1 if e is None else e, st.in_features) for (m, e), st in table.items()]
            keys = sorted(set().union(*map(set, ctx.all_gather_object(mine))))
            order = []
            for m, e, n in keys:
                key = (m, None if e == -1 else e)
                if key not in table:
                    table[key] = ActivationStats(n, device=self.device)
                order.append(table[key])
            if not order:
                continue
            amax = ctx.all_reduce_max_(torch.stack([st.amax.reshape(()) for st in order]))
            sums = ctx.all_reduce_sum_(torch.cat([st.sum_sq for st in order]))
            tokens = ctx.all_reduce_sum_(torch.tensor([st.tokens for st in order], dtype=torch.int64, device=amax.device))
            offset = 0
            for i, st in enumerate(order):
                st.amax = amax[i].clone()
                st.sum_sq = sums[offset : offset + st.in_features].clone()
                st.tokens = int(tokens[i])
                offset += st.in_features
        counts = self.expert_tokens
        size = max(ctx.all_gather_object(0 if counts is None else counts.numel()))
        if size:
            mine = torch.zeros(size, dtype=torch.int64, device=self.device)
            if counts is not None:
                mine[: counts.numel()] = counts
            self.expert_tokens = ctx.all_reduce_sum_(mine)
        self.router_tokens = sum(ctx.all_gather_object(self.router_tokens))
        self._last = None

    def tokens_per_expert(self, n_experts: int) -> list[int]:
        """Router assignments per expert for the current layer (zeros for experts never chosen)."""
        out = [0] * n_experts
        if self.expert_tokens is not None:
            for e, c in enumerate(self.expert_tokens.tolist()[:n_experts]):
                out[e] = int(c)
        return out


def save_activation_stats(
    directory: Path, prefix: str, layer: int, modules: list[str], collector: ActivationCollector
) -> None:
    """Per quantized linear of the layer (`modules`, without the layer `prefix`): input amax, per-channel mean
    square, token count (for later methods), in `directory/layer_LLL.safetensors`."""
    wanted = set(modules)
    writer = ShardWriter(directory / f"layer_{layer:03d}.safetensors", metadata={"layer": str(layer)})
    for (module, _expert), stats in sorted(collector.routed.items(), key=lambda kv: kv[0][0]):
        if module not in wanted:
            continue
        writer.add(f"{prefix}{module}.input_amax", stats.amax.detach().cpu().reshape(()))
        writer.add(f"{prefix}{module}.input_mean_square", stats.mean_square())
        writer.add(f"{prefix}{module}.tokens", torch.tensor(stats.tokens, dtype=torch.int64))
    if len(writer):
        directory.mkdir(parents=True, exist_ok=True)
        writer.commit()
