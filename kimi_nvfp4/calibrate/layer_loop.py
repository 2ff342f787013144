"""calibrate's layer loop (`run_calibration`): per layer, load once, attend once, observe (W4A16, statistics
only), choose the layer's input scales, advance (W4A4 with them); with an expert-statistics or fused-method hook
beside it. `calibrate_checkpoint` (calibrate/api.py) checks, plans and writes around it."""

from __future__ import annotations

import time
from functools import partial
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import torch

from ..checkpoint.reader import CheckpointReader
from ..distributed import RankContext
from ..stage_kit.progress import job_tokens, layer_progress
from ..model import LayerStreamRunner, NVFP4Weights
from ..model.linear import NVFP4Linear
from ..model.runner import CUDA_MAX_CHUNK_TOKENS, DEFAULT_MAX_CHUNK_TOKENS
from ..stage_kit.device import AUTO_DTYPE, PhaseClock, dtype_name, resolve_dtype, synchronize
from .policy import (
    EXPERT_INPUT_GROUPS,
    ExpertAmax,
    ExpertPolicy,
    choose_expert_amax,
    input_scale_from_amax,
)
from .report import ExpertCalibration, LayerCalibration, LinearRange
from .stats import ActivationCollector, save_activation_stats
from .resume import restore_calibration, save_calibration
from ..stage_kit.resume import ResumeStore, Snapshot
from .kv_cache import KVCacheRanges, with_kv_cache
from .expert_stats_hook import ExpertStatsHook
from .fused_method import FusedMethodHook
from ..stage_kit.layer_memory import LayerMemory

CUDA_CHUNK_TOKENS = CUDA_MAX_CHUNK_TOKENS  # tokens per MLP/MoE chunk on CUDA when not given (runner.py)


def quantized_modules(reader: CheckpointReader, layer: int) -> list[str]:
    """NVFP4 linears of one layer, as module names without the layer prefix (`mlp.experts.3.up_proj`)."""
    prefix = reader.layout.layer_prefix(layer)
    return sorted(
        n[len(prefix) : -len(".weight_scale_2")]
        for n in reader.weight_map
        if n.startswith(prefix) and n.endswith(".weight_scale_2")
    )


def _expert_of(module: str) -> tuple[int, str] | None:
    parts = module.split(".")
    if len(parts) == 4 and parts[0] == "mlp" and parts[1] == "experts":
        return int(parts[2]), parts[3]
    return None


def _layer_scales(
    reader: CheckpointReader,
    layer: int,
    collector: ActivationCollector,
    *,
    policy: ExpertPolicy,
    min_expert_tokens: int,
) -> tuple[dict[str, torch.Tensor], LayerCalibration]:
    """input_scale tensors (full names) for one layer's NVFP4 linears, and the layer's report entry."""
    prefix = reader.layout.layer_prefix(layer)
    modules = quantized_modules(reader, layer)
    n_experts = reader.layout.text.n_routed_experts if reader.layout.text.is_moe_layer(layer) else 0
    scales: dict[str, torch.Tensor] = {}
    tokens = collector.tokens_per_expert(n_experts)
    by: dict[tuple[int, str], ExpertAmax] = {}
    entry = LayerCalibration(
        layer=layer,
        is_moe=n_experts > 0,
        linears=[
            LinearRange(module=m, amax=s.amax_value, tokens=s.tokens)
            for (m, e), s in sorted(collector.routed.items(), key=lambda kv: kv[0][0])
            if e is None
        ],
    )
    if any(_expert_of(m) for m in modules):
        chosen = choose_expert_amax(
            collector.routed, collector.all_tokens, tokens, policy=policy, min_expert_tokens=min_expert_tokens
        )
        by = {(c.expert, c.group): c for c in chosen}
        experts = ExpertCalibration(
            tokens=tokens,
            gate_up_amax=[by[(e, "gate_up")].amax for e in range(n_experts)],
            down_amax=[by[(e, "down")].amax for e in range(n_experts)],
            gate_up_source=[by[(e, "gate_up")].source for e in range(n_experts)],
            down_source=[by[(e, "down")].source for e in range(n_experts)],
        )
        entry.experts = experts
        entry.experts_below_min_tokens = sum(1 for t in tokens if t < min_expert_tokens)
        entry.experts_without_tokens = sum(1 for t in tokens if t == 0)
        entry.gate_up_amax_max = max(experts.gate_up_amax)
        entry.down_amax_max = max(experts.down_amax)
    for m in modules:
        ep = _expert_of(m)
        if ep is not None:
            e, proj = ep
            amax = by[(e, EXPERT_INPUT_GROUPS[proj])].amax
        else:
            stats = collector.routed.get((m, None))
            amax = stats.amax_value if stats is not None else 0.0
        scales[f"{prefix}{m}.input_scale"] = input_scale_from_amax(amax)
    return scales, entry


@dataclass
class CalibrationRun:
    """What the layer loop produced: the scales, the per-layer report entries, seconds per layer,
    and how it ran (compute dtype, chunk size, layers dequantized once)."""

    scales: dict[str, torch.Tensor]
    layers: list[LayerCalibration]
    layer_seconds: list[float]
    dtype: str = "float32"
    # per layer, seconds by phase (load wait, attention, observe pass, scales, advance pass)
    phase_seconds: list[dict[str, float]] = field(default_factory=list)
    max_chunk_tokens: int | None = None
    materialized_layers: list[int] = field(default_factory=list)
    kv_ranges: KVCacheRanges | None = None  # what the MLA cache held per layer (when asked for)
    memory: LayerMemory = field(default_factory=LayerMemory)  # per layer, peak GPU / host memory


def _outside_mlp(modules: list[str]) -> bool:
    """Whether a layer has NVFP4 linears before its MLP (attention): then the attention output of the
    W4A4 pass differs from the W4A16 observe pass and must be recomputed. Not so in K2.6 (BF16 MLA)."""
    return any(not m.startswith("mlp.") for m in modules)


def run_calibration(
    reader: CheckpointReader,
    sequences: list[torch.Tensor],
    *,
    policy: ExpertPolicy,
    min_expert_tokens: int,
    device: torch.device,
    layers: Iterable[int] | None = None,
    max_chunk_tokens: int | None = None,
    states_device: str | torch.device | None = None,
    stats_dir: Path | None = None,
    progress: bool = True,
    dtype: str | torch.dtype = AUTO_DTYPE,
    materialize: bool | str = "auto",
    prefetch: bool | None = None,
    ctx: RankContext | None = None,
    kv_cache: bool = False,
    expert_stats: ExpertStatsHook | FusedMethodHook | None = None,
    resume: ResumeStore | None = None,
    snapshot: Snapshot | None = None,
) -> CalibrationRun:
    """The observe / choose / advance loop over `layers` (default all) of the converted checkpoint.

    Each layer is loaded once and its attention runs once (unless it has NVFP4 linears itself): the
    observe pass (W4A16, statistics only) and the advance pass (W4A4 with the chosen scales) share the
    post-attention residual and the loaded weights, switched in place with `set_activations`.
    `dtype`: "auto" (bf16 on CUDA, fp32 on CPU), "float32" or "bfloat16". `materialize`: dequantize a
    layer once ("auto": on CUDA when it fits, see LayerStreamRunner). `prefetch`: load layer L+1 while
    L computes (one more stored layer in memory; default: on CUDA). `max_chunk_tokens` None:
    CUDA_CHUNK_TOKENS on CUDA, the runner's default elsewhere. `ctx`: under torchrun, `sequences` is
    this rank's share and the statistics of all ranks are combined before each layer's scales are
    chosen, so every rank computes the same scales (kimi_nvfp4.distributed). `kv_cache`: also record
    what each layer's MLA cache holds (`run.kv_ranges`, for the FP8 KV scales of calibrate/kv_cache.py).
    `expert_stats`: also record each routed expert's input statistics and write them per layer
    (calibrate/expert_stats_hook.py; `w4a4` records them in the advance pass, with the scales just chosen), or,
    a `FusedMethodHook`, solve each MoE layer's experts from them in memory (calibrate/fused_method.py).
    `resume`: snapshot the run every `resume.every` layers;
    `snapshot`: continue after the layer it was taken at instead of from the embeddings (calibrate/resume.py).
    """
    ctx = ctx or RankContext()
    compute_dtype = resolve_dtype(dtype, device)
    if prefetch is None:
        prefetch = device.type == "cuda"
    if max_chunk_tokens is None:
        max_chunk_tokens = CUDA_CHUNK_TOKENS if device.type == "cuda" else DEFAULT_MAX_CHUNK_TOKENS
    source = NVFP4Weights(reader, activations="w4a16")
    runner = LayerStreamRunner(
        source, device=device, dtype=compute_dtype, max_chunk_tokens=max_chunk_tokens, states_device=states_device,
        progress=False, materialize_layers=materialize, prefetch=prefetch,
    )
    cfg = reader.layout.text
    order = list(range(cfg.num_hidden_layers) if layers is None else layers)
    collector = ActivationCollector(device=device)
    observer = collector if expert_stats is None else expert_stats.observer(collector, device)
    run = CalibrationRun({}, [], [], dtype=dtype_name(compute_dtype), max_chunk_tokens=max_chunk_tokens)
    run.kv_ranges = KVCacheRanges(device=device) if kv_cache else None
    if snapshot is not None:
        states = restore_calibration(snapshot, run, runner, expert_stats, device)
        done = order.index(snapshot.layer) + 1
    else:
        states, done = runner.embed(sequences), 0
    tokens = job_tokens(ctx, sum(int(s.numel()) for s in sequences))
    for layer in layer_progress(order[done:], tokens_per_layer=tokens, desc="calibrate: layers", enabled=progress,
                                done=done):
        t0, clock = time.perf_counter(), PhaseClock(device)
        run.memory.start(device)
        collector.start_layer(layer)
        if expert_stats is not None:
            expert_stats.start_layer(layer)
        modules = quantized_modules(reader, layer)
        collector.route_all = bool(modules) and policy is ExpertPolicy.ROUTE_ALL and cfg.is_moe_layer(layer)
        w = runner.load_layer(layer)
        clock.mark("load")
        attended = runner.attend(layer, states, w, observer=with_kv_cache(collector, run.kv_ranges))
        clock.mark("attention")
        if not modules:  # no NVFP4 linear: W4A16 and W4A4 agree, one pass is both
            states = runner.feed_forward(attended, w, observer=observer)
        else:
            recompute_attention = _outside_mlp(modules)
            if not recompute_attention:
                states = attended  # drop the layer input now: the W4A4 pass starts from `attended` too
            runner.feed_forward(attended, w, observer=observer, output=False)  # observe: statistics only
        clock.mark("observe")
        collector.combine_ranks(ctx)
        if expert_stats is not None:
            expert_stats.observe_done(layer, reader, ctx, rerun=partial(runner.feed_forward, attended, w, output=False))
        layer_scales, entry = _layer_scales(
            reader, layer, collector, policy=policy, min_expert_tokens=min_expert_tokens
        )
        run.layers.append(entry)
        if stats_dir is not None and ctx.is_main:
            save_activation_stats(stats_dir, reader.layout.layer_prefix(layer), layer, modules, collector)
        clock.mark("scales")
        if modules:
            run.scales.update(layer_scales)
            if expert_stats is not None:  # --propagation sequential: the requantized experts advance
                expert_stats.advance_weights(source, w)
            source.set_activations(w, "w4a4", input_scales=layer_scales)  # advance: same weights, W4A4
            if recompute_attention:
                attended = runner.attend(layer, states, w)
            advance_observer = None if expert_stats is None else expert_stats.advance_observer(w)
            states = runner.feed_forward(attended, w, observer=advance_observer)
            clock.mark("advance")
        if expert_stats is not None:
            expert_stats.finish_layer(layer, reader, ctx)
        if any(isinstance(lin, NVFP4Linear) and lin.materialized for lin in w.linears()):
            run.materialized_layers.append(layer)
        del w, attended
        synchronize(device)
        run.layer_seconds.append(time.perf_counter() - t0)
        run.phase_seconds.append(clock.seconds)
        run.memory.stop(device)
        done += 1
        if resume is not None and resume.due(done, len(order)):
            save_calibration(resume, layer, states, run, expert_stats)
    if run.kv_ranges is not None:
        run.kv_ranges.combine_ranks(ctx)
    return run
