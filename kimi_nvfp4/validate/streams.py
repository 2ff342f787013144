"""The side-by-side run `validate_checkpoint` measures: the INT4 stream and one NVFP4 stream per emulation mode (plus
the amax baseline), stepped through the layer-streamed reference model together (`compare_streams`), and how each
NVFP4 layer is loaded for the modes it can serve."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

import torch

from ..stage_kit.device import AUTO_DTYPE, PhaseClock, resolve_dtype, synchronize
from ..stage_kit.layer_memory import LayerMemory
from ..stage_kit.progress import job_tokens, layer_progress
from ..checkpoint.reader import CheckpointReader
from ..distributed import RankContext
from ..errors import CheckpointError
from ..model import Int4SourceWeights, LayerStreamRunner, NVFP4Weights
from ..model.layer_weights import LayerWeights, MoEWeights
from ..model.linear import ActivationMode, NVFP4Linear
from ..model.runner import CUDA_MAX_CHUNK_TOKENS, DEFAULT_MAX_CHUNK_TOKENS
from ..model.nvfp4_linears import InputScaleReduction
from .baseline import BASELINE_NAME, baseline_layer
from .experts import DEFAULT_EXPERT_CHECK_TOKENS, ExpertError, ExpertErrorObserver
from .metrics import RelativeError, TokenComparison, stream_drift
from .ranks import merge_counts, merge_relative_errors, merge_token_comparison
from .resume import ValidationResume
from .report import EndToEnd, LayerValidation
from .weights import WeightComparer, WeightSummary


def _runner_kwargs(dev, max_chunk_tokens, states_device, dtype, prefetch, materialize) -> dict:
    if max_chunk_tokens is None:
        max_chunk_tokens = CUDA_MAX_CHUNK_TOKENS if dev.type == "cuda" else DEFAULT_MAX_CHUNK_TOKENS
    return {
        "device": dev, "progress": False, "states_device": states_device, "dtype": dtype,
        "max_chunk_tokens": max_chunk_tokens, "materialize_layers": materialize, "prefetch": prefetch,
    }


@dataclass
class StreamComparison:
    """Everything the side-by-side run measured (before gates)."""

    layers: list[LayerValidation]
    expert_errors: list[ExpertError]
    end_to_end: list[EndToEnd]
    weights: WeightSummary | None
    mode_errors: dict[str, str]
    layer_seconds: list[float] = field(default_factory=list)
    # per layer, seconds by phase (load wait, weight check, each stream...): where a layer's time goes
    phase_seconds: list[dict[str, float]] = field(default_factory=list)
    memory: LayerMemory = field(default_factory=LayerMemory)  # per layer, peak GPU / host memory
    logits_seconds: float = 0.0
    baseline: EndToEnd | None = None

    def set_baseline(self, e2e: EndToEnd) -> None:
        self.baseline = e2e


def compare_streams(
    src_reader: CheckpointReader,
    out_reader: CheckpointReader,
    sequences: list[torch.Tensor],
    *,
    modes: Sequence[ActivationMode],
    reduction: InputScaleReduction,
    device: torch.device,
    flag_rel_mse: float,
    max_chunk_tokens: int | None = None,
    states_device: str | torch.device | None = None,
    progress: bool = True,
    dtype: str | torch.dtype = AUTO_DTYPE,
    prefetch: bool | None = None,
    materialize: bool | str = "auto",
    ctx: RankContext | None = None,
    baseline: bool = False,
    expert_check_tokens: int | None = DEFAULT_EXPERT_CHECK_TOKENS,
    resume: ValidationResume | None = None,
) -> StreamComparison:
    """Step the INT4 stream and one NVFP4 stream per mode through every layer, then compare logits.

    Each layer is read ONCE per checkpoint: the NVFP4 layer (dequantized once when it fits) serves the
    per-expert comparison, the W4A4 stream and then, switched in place to W4A16, the W4A16 stream (the
    weights do not depend on the activation mode); the weight check reads the layers already loaded.
    `prefetch` (default: on CUDA) reads layer L+1 of both checkpoints while layer L computes.
    `ctx`: under torchrun, `sequences` is this rank's share; every figure is combined over the ranks
    (validate/ranks.py) and is the same on every rank. `baseline`: one more W4A16 stream whose experts are
    the amax (Model Optimizer rule) conversion of the same INT4 experts (validate/baseline.py). `resume`: snapshot
    the streams every `resume.store.every` layers, and continue from `resume.snapshot` if set (validate/resume.py).
    `expert_check_tokens`: tokens compared per expert and layer in the per-expert check (validate/experts.py).
    `materialize`: dequantize each layer once (True), per chunk (False), or "auto" (when it fits the free memory);
    validate_checkpoint passes its memory plan's choice.
    """
    ctx = ctx or RankContext()
    compute_dtype = resolve_dtype(dtype, device)
    if prefetch is None:
        prefetch = device.type == "cuda"
    kw = _runner_kwargs(device, max_chunk_tokens, states_device, compute_dtype, prefetch, materialize)
    ref_runner = LayerStreamRunner(Int4SourceWeights(src_reader), **kw)
    wanted = list(dict.fromkeys(modes))
    # one NVFP4 source, opened in the most demanding mode asked for; W4A16 is a switch away
    first = ActivationMode.W4A4 if ActivationMode.W4A4 in wanted else ActivationMode.W4A16
    nv_source = NVFP4Weights(out_reader, activations=first.value, input_scale_reduction=reduction.value)
    nv_runner = LayerStreamRunner(nv_source, **kw)
    fallback_source = NVFP4Weights(out_reader, activations="w4a16", input_scale_reduction=reduction.value)
    comparer = WeightComparer(src_reader, out_reader, device, flag_rel_mse=flag_rel_mse)
    cfg = out_reader.layout.text
    result = StreamComparison([], [], [], None, {})
    if resume is not None and resume.snapshot is not None:
        ref_states, states, base_states, start = resume.restore(result, comparer, ref_runner, nv_runner, wanted)
    else:
        ref_states = ref_runner.embed(sequences)
        states = {mode: nv_runner.embed(sequences) for mode in wanted}
        base_states = nv_runner.embed(sequences) if baseline else None
        start = 0

    tokens = job_tokens(ctx, sum(int(s.numel()) for s in sequences))
    n_layers = cfg.num_hidden_layers
    for layer in layer_progress(range(start, n_layers), tokens_per_layer=tokens, desc="validate: layers",
                                enabled=progress, done=start):
        t0, clock = time.perf_counter(), PhaseClock(device)
        result.memory.start(device)
        w_ref = ref_runner.load_layer(layer)
        w_nv = _load_nvfp4_layer(nv_runner, fallback_source, layer, device, compute_dtype, states, result)
        clock.mark("load")
        observer = None
        if cfg.is_moe_layer(layer):
            comparer.add_loaded_layer(layer, w_ref, w_nv, ctx)
            clock.mark("weight_check")
            if w_nv is not None:
                observer = ExpertErrorObserver(
                    layer, w_nv, [m for m in states if _usable(w_nv, m)], max_tokens=expert_check_tokens
                )
        w_base = baseline_layer(w_ref, w_nv) if base_states is not None and w_nv is not None else None
        clock.mark("baseline_weights")
        attended = ref_runner.attend(layer, ref_states, w_ref, observer)
        del ref_states
        clock.mark("int4_attention")
        new_ref = ref_runner.feed_forward(attended, w_ref, observer)
        del w_ref, attended
        clock.mark("int4_mlp_and_expert_check")
        entry = LayerValidation(layer=layer, drift={})
        drift: dict[ActivationMode, RelativeError] = {}
        if observer is not None:
            observer.errors = merge_relative_errors(ctx, observer.errors)
            observer.tokens = merge_counts(ctx, observer.tokens)
            found = observer.results()
            del observer
            result.expert_errors += found
            for mode in states:
                mine = [x for x in found if x.mode == mode.value]
                if mine:
                    worst = max(mine, key=lambda x: x.rel_mse)
                    entry.expert_rel_mse_max[mode.value] = worst.rel_mse
                    entry.worst_expert[mode.value] = worst.expert
        for mode in list(states):
            if w_nv is None:
                break
            nv_source.set_activations(w_nv, mode.value)
            attended = nv_runner.attend(layer, states[mode], w_nv)
            clock.mark(f"{mode.value}_attention")
            states[mode] = nv_runner.feed_forward(attended, w_nv)
            del attended
            drift[mode] = stream_drift(new_ref, states[mode], device)
            clock.mark(f"{mode.value}_mlp")
        for mode, err in merge_relative_errors(ctx, drift).items():
            entry.drift[mode.value] = err.rel_mse
        if w_base is not None:
            if isinstance(w_nv.mlp, MoEWeights):
                # the checkpoint's dequantized experts are done with: their room lets the baseline's materialize
                _drop_dequantized_experts(w_nv.mlp)
            base_states = nv_runner.feed_forward(nv_runner.attend(layer, base_states, w_base), w_base)
            merged = merge_relative_errors(ctx, {BASELINE_NAME: stream_drift(new_ref, base_states, device)})
            entry.baseline_drift = merged[BASELINE_NAME].rel_mse
            clock.mark("baseline_stream")
        del w_nv, w_base
        ref_states = new_ref
        result.layers.append(entry)
        synchronize(device)
        result.layer_seconds.append(time.perf_counter() - t0)
        result.phase_seconds.append(clock.seconds)
        result.memory.stop(device)
        if resume is not None and resume.store.due(layer + 1, n_layers):
            resume.save(layer, ref_states, states, base_states, result, comparer)

    runners = {mode: nv_runner for mode in states}
    t0 = time.perf_counter()
    comparisons = {mode: TokenComparison() for mode in runners}
    streams = {mode: nv_runner.logits(states[mode]) for mode in runners}
    if base_states is not None:
        comparisons[BASELINE_NAME] = TokenComparison()
        streams[BASELINE_NAME] = nv_runner.logits(base_states)
    for seq, ref_logits in zip(sequences, ref_runner.logits(ref_states)):
        for mode, it in streams.items():
            comparisons[mode].add(ref_logits, next(it), seq)
    synchronize(device)
    result.logits_seconds = time.perf_counter() - t0
    for mode, c in list(comparisons.items()):
        c = comparisons[mode] = merge_token_comparison(ctx, c)
        edges, counts = c.kl_histogram()
        (result.end_to_end.append if mode != BASELINE_NAME else result.set_baseline)(
            EndToEnd(
                mode=mode if mode == BASELINE_NAME else mode.value,
                positions=c.positions,
                kl_mean=c.kl_mean,
                kl_p99=c.kl_p99,
                kl_max=c.kl_max,
                top1=c.top1,
                ppl_int4=c.ppl_ref,
                ppl_nvfp4=c.ppl_test,
                ppl_ratio=c.ppl_ratio,
                kl_histogram_edges=edges,
                kl_histogram_counts=counts,
            )
        )
    result.weights = comparer.summary() if cfg.moe_layers else None
    return result


def _usable(w: LayerWeights, mode: ActivationMode) -> bool:
    """Whether the loaded NVFP4 layer can be emulated in `mode` (W4A4 needs its input scales)."""
    if mode is ActivationMode.W4A16:
        return True
    return all(lin.input_scale is not None for lin in w.linears() if isinstance(lin, NVFP4Linear))


def _load_nvfp4_layer(
    runner: LayerStreamRunner,
    fallback: NVFP4Weights,
    layer: int,
    device: torch.device,
    dtype: torch.dtype,
    states: dict,
    result: StreamComparison,
) -> LayerWeights | None:
    """The NVFP4 layer in the runner's mode; when W4A4 cannot load (an input_scale missing), the
    W4A4 stream stops with its reason and the layer is loaded for W4A16 alone. None when even that
    fails: every NVFP4 stream stops with the reason."""
    try:
        return runner.load_layer(layer)
    except CheckpointError as e:
        if ActivationMode.W4A4 in states:
            result.mode_errors[ActivationMode.W4A4.value] = f"layer {layer}: {e}"
            del states[ActivationMode.W4A4]
    if not states:
        return None
    try:
        return fallback.layer(layer, device, dtype)
    except CheckpointError as e:
        for mode in list(states):
            result.mode_errors[mode.value] = f"layer {layer}: {e}"
            del states[mode]
        return None


def _drop_dequantized_experts(mlp: MoEWeights) -> None:
    """Drop the routed experts' dequantized copies (the baseline shares the rest of the layer). A function of its own
    so that its loop variables go with it: bound in the layer loop, the last `lin` kept `lin.group` (every routed
    expert's tensors of the layer, model/nvfp4_linears.py) alive until the next MoE layer, 8.9 GiB at K2.6."""
    for expert in mlp.experts:
        for lin in expert.linears():
            lin.drop_materialized()
