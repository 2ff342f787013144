"""The K2 MLPs: dense SwiGLU (layer 0, shared expert) and the sigmoid-routed MoE.

Routing (`noaux_tc`, DeepSeek-V3; transformers DeepseekV3TopkRouter, SGLang `biased_grouped_topk`):
scores = sigmoid(x @ gate.T) in fp32; `e_score_correction_bias` is added for SELECTION only
(groups ranked by the sum of their top-2 biased scores, keep `topk_group` of `n_group`, then top-k
experts); the combine weights are the unbiased scores of the chosen experts, normalised to sum 1
(`norm_topk_prob`) and multiplied by `routed_scaling_factor`.

Experts run on an expert-sorted gather of their routed tokens (no dense [T, E, ...] tensors; see
EXPERT_PATHS); each token's routed outputs are summed in ascending expert order (as transformers'
loop does), without atomics: same bytes run to run. The routed sum is
kept in fp32 whatever the compute dtype (the fused MoE kernels' finalize step accumulates in fp32 and
writes bf16 once); in fp32 that is the same arithmetic as before.

W4A4 activation quantization is row-local (per token, per 16 inputs), so when every routed expert's
gate_proj/up_proj use the same input scale (SGLang's flashinfer `layer_max` reduction, the default)
the chunk is quantized ONCE and each expert gathers its rows from it -- bit-identical to quantizing
each expert's gathered rows, and 2 x n_experts fewer quantizations of `top_k` rows each. down_proj
cannot share: each expert's input is its own SwiGLU output.

`need_output=False` (statistics-only passes: calibrate's observe pass, `route_all`) skips what only the
output needs -- the combine, and down_proj's matmul when the observer says `needs_outputs = False`
(it then gets `y=None` for down_proj; its input, what calibration measures, is unchanged).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..checkpoint.k2_config import K2Config
from .layer_weights import MLPWeights, MoEWeights
from .batch_invariant import linear_row_spans, linear_rows, pointwise_rows
from .linear import Linear
from .observer import Observer, expert_rows_observer, notify_linear

# transformers DeepseekV3TopkRouter: `denominator = topk_weights.sum(...) + 1e-20`
_NORM_EPS = 1e-20
# Groups are ranked by the sum of their best two biased scores (DeepSeek-V3 noaux_tc).
_GROUP_SCORE_TOP = 2


def observer_needs_outputs(observer: Observer | None) -> bool:
    """Whether `observer` reads the `y` of linears (True unless it says `needs_outputs = False`)."""
    return observer is not None and getattr(observer, "needs_outputs", True)


def statistics_expert_range(observer: Observer | None, need_output: bool) -> tuple[int, int] | None:
    """The routed experts [lo, hi) a statistics-only pass must run, when its observer wants no more (calibrate's
    expert groups, calibrate/expert_stats.py: `experts_only`); None: every expert and the shared one."""
    if need_output or observer is None or not getattr(observer, "experts_only", False):
        return None
    return observer.expert_range


def swiglu_mlp(
    w: MLPWeights, x: torch.Tensor | None, *, layer: int, observer: Observer | None = None,
    expert: int | None = None, routed: bool = True, xq: torch.Tensor | None = None, need_output: bool = True,
) -> torch.Tensor | None:
    """`down(silu(gate(x)) * up(x))`, reporting each linear (with the raw `x`) to the observer.

    `xq`: `x` already through the input quantization gate_proj and up_proj share (the caller
    quantized a whole chunk; `x` may then be None when there is no observer). Otherwise `x` is
    quantized once for both when they hold the same scale tensor (SGLang runs them as one w13 GEMM
    with one scale; the loader gives them one tensor). `need_output=False`: the result is not used
    (returns None; see the module docstring).
    """
    gate_lin, up_lin, down_lin = w.gate_proj, w.up_proj, w.down_proj
    if xq is None:
        xq = gate_lin.quantize_input(x)
        xq_up = xq if up_lin.input_quantizer() is gate_lin.input_quantizer() else up_lin.quantize_input(x)
    else:
        xq_up = xq  # the caller quantized with the quantizer gate and up share
    gate = gate_lin.matmul(xq)
    notify_linear(observer, layer, gate_lin.module, x, gate, expert, routed)
    up = up_lin.matmul(xq_up)
    notify_linear(observer, layer, up_lin.module, x, up, expert, routed)
    h = pointwise_rows(_swiglu, gate, up)
    if not need_output and not observer_needs_outputs(observer):
        notify_linear(observer, layer, down_lin.module, h, None, expert, routed)
        return None
    out = down_lin(h)
    notify_linear(observer, layer, down_lin.module, h, out, expert, routed)
    return out if need_output else None


def _swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def shared_input_quantizer(linears: list[Linear]) -> Linear | None:
    """A linear whose input quantization every one of `linears` shares (None: they differ, or it is
    the identity and there is nothing to share). Identical scale tensors are checked first (no device
    sync); equal values in distinct tensors cost one comparison."""
    if not linears:
        return None
    first = linears[0].input_quantizer()
    if first is None:
        return None
    scales = [lin.input_quantizer() for lin in linears]
    if any(s is None for s in scales):
        return None
    if all(s is first for s in scales):
        return linears[0]
    stacked = torch.stack([s.reshape(()).to(first.device) for s in scales])
    return linears[0] if bool((stacked == first).all()) else None


def route(cfg: K2Config, w: MoEWeights, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`(topk_ids [T, k] long, topk_weights [T, k] fp32)`, ids in descending biased-score order."""
    scores = pointwise_rows(torch.sigmoid, linear_rows(x.to(torch.float32), w.router_weight.to(torch.float32)))
    choice = scores if w.e_score_correction_bias is None else scores + w.e_score_correction_bias.to(torch.float32)
    n_experts = scores.shape[-1]
    if cfg.n_group > 1 and cfg.topk_group < cfg.n_group:
        grouped = choice.view(-1, cfg.n_group, n_experts // cfg.n_group)
        group_scores = grouped.topk(_GROUP_SCORE_TOP, dim=-1).values.sum(dim=-1)
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, group_scores.topk(cfg.topk_group, dim=-1).indices, True)
        choice = grouped.masked_fill(~keep[..., None], float("-inf")).view(-1, n_experts)
    topk_ids = choice.topk(cfg.num_experts_per_tok, dim=-1, sorted=True).indices
    weights = scores.gather(1, topk_ids)
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + _NORM_EPS)
    return topk_ids, weights * cfg.routed_scaling_factor


# How routed experts run. "sorted" (the default): every (token, expert) pair is gathered ONCE into an
# expert-sorted buffer and each expert's GEMMs read and write contiguous slices of it; the SwiGLU, the
# W4A4 quantization of down_proj's input (when the experts share its scale) and the combine run once over
# the whole buffer. "loop": the reference, one gather-matmul-scatter per expert. Both do the same
# arithmetic per expert on the same rows (same GEMM shapes, same fp32 combine order), so they give the
# same bytes; tests/model/test_moe_paths.py holds them to that.
EXPERT_PATHS = ("sorted", "loop")
DEFAULT_EXPERT_PATH = "sorted"


def moe(
    cfg: K2Config, w: MoEWeights, x: torch.Tensor, *, layer: int, observer: Observer | None = None,
    need_output: bool = True, expert_path: str = DEFAULT_EXPERT_PATH,
) -> torch.Tensor | None:
    """Routed experts + shared expert for `x [T, hidden]` (already post_attention_layernorm'ed)."""
    if expert_path not in EXPERT_PATHS:
        raise ValueError(f"expert_path must be one of {EXPERT_PATHS}, got {expert_path!r}")
    topk_ids, topk_weights = route(cfg, w, x)
    if observer is not None:
        observer.on_router(layer, topk_ids, topk_weights)
    quantizer = shared_input_quantizer([lin for e in w.experts for lin in (e.gate_proj, e.up_proj)])
    xq = quantizer.quantize_input(x) if quantizer is not None else None
    routed = _routed_sorted if expert_path == "sorted" else _routed_loop
    out = routed(w, x, xq, topk_ids, topk_weights, layer=layer, observer=observer, need_output=need_output)

    if observer is not None and getattr(observer, "route_all", False):
        # statistics only: every token through every expert; the result is discarded
        for e in range(len(w.experts)):
            swiglu_mlp(w.experts[e], x, layer=layer, observer=observer, expert=e, routed=False, xq=xq,
                       need_output=False)

    shared = None
    if w.shared_experts is not None and statistics_expert_range(observer, need_output) is None:
        shared = swiglu_mlp(w.shared_experts, x, layer=layer, observer=observer, need_output=need_output)
    if out is None:
        return None
    out = out.to(x.dtype)
    return out + shared if shared is not None else out


def _routed_loop(
    w: MoEWeights, x: torch.Tensor, xq: torch.Tensor | None, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
    *, layer: int, observer: Observer | None, need_output: bool,
) -> torch.Tensor | None:
    """The reference: per expert, gather its tokens, run its SwiGLU, scatter-add the weighted result
    (each token's routed outputs summed in ascending expert order, in fp32)."""
    T, hidden = x.shape
    k = topk_ids.shape[1]
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert
    counts = torch.bincount(flat, minlength=len(w.experts)).tolist()  # one host sync per chunk
    out = torch.zeros(T, hidden, dtype=torch.float32, device=x.device) if need_output else None
    wanted = statistics_expert_range(observer, need_output)
    start = 0
    for e, count in enumerate(counts):
        if count == 0:
            continue
        pairs = order[start : start + count]
        start += count
        if wanted is not None and not wanted[0] <= e < wanted[1]:
            continue
        tokens, slots = pairs // k, pairs % k  # a token meets an expert at most once: `tokens` is unique
        rows = x[tokens] if xq is None or observer is not None else None
        y = swiglu_mlp(
            w.experts[e], rows, layer=layer, observer=observer, expert=e,
            xq=xq[tokens] if xq is not None else None, need_output=need_output,
        )
        if out is not None:
            out[tokens] = out[tokens] + y.to(torch.float32) * topk_weights[tokens, slots, None].to(torch.float32)
    return out


# Dequantized expert weights alive at once when a layer is not materialized (each expert's weight is decoded per
# chunk): the experts of one grouped launch (batch_invariant.linear_row_spans). 512 MiB is ~17 K2.6 expert matrices
# ([2048, 7168] bf16): a few dozen launches per chunk instead of one per expert, within the memory plan's headroom
# (stage_kit/memory_estimate.py GPU_HEADROOM_BYTES).
DEQUANTIZED_GROUP_BYTES = 512 * 2**20


def _expert_products(x: torch.Tensor, spans: list[tuple[int, int, int]], linears: list[Linear],
                     out: torch.Tensor) -> None:
    """`out[a:b] = x[a:b] @ W_e^T` for each expert span, the experts' weights taken in groups: all at once when they
    are held dequantized, else up to DEQUANTIZED_GROUP_BYTES of decoded weights per group."""
    groups, decoded = [[]], 0
    for span, lin in zip(spans, linears):
        size = lin.dequantized_bytes()
        if groups[-1] and decoded + size > DEQUANTIZED_GROUP_BYTES:
            groups.append([])
            decoded = 0
        groups[-1].append((span, lin))
        decoded += size
    for group in groups:
        weights = [lin.weight() for _, lin in group]
        linear_row_spans(x, [(a, b) for (_, a, b), _ in group], weights, out)
        del weights


def _routed_sorted(
    w: MoEWeights, x: torch.Tensor, xq: torch.Tensor | None, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
    *, layer: int, observer: Observer | None, need_output: bool,
) -> torch.Tensor | None:
    """The same experts over one expert-sorted buffer (see EXPERT_PATHS)."""
    T, hidden = x.shape
    k = topk_ids.shape[1]
    # Each token's slots in ascending expert order: the combine below then adds a token's routed
    # outputs in the order the reference loop does.
    ids, slot_order = topk_ids.sort(dim=1, stable=True)
    weights = topk_weights.gather(1, slot_order).to(torch.float32)
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=len(w.experts)).tolist()  # one host sync per chunk
    wanted = statistics_expert_range(observer, need_output)
    if wanted is not None:  # one expert group's pass: its experts' pairs are one run of the sorted order
        lo, hi = wanted
        order = order[sum(counts[:lo]) : sum(counts[:hi])]
        counts = [c if lo <= e < hi else 0 for e, c in enumerate(counts)]
    tokens = order // k
    rows = x[tokens] if xq is None or observer is not None else None
    rows_q = xq[tokens] if xq is not None else rows
    spans = []
    start = 0
    for e, count in enumerate(counts):
        if count:
            spans.append((e, start, start + count))
        start += count

    # an observer that takes the whole buffer gets one call per input instead of one per expert and linear
    batch = expert_rows_observer(observer) if spans else None
    if batch is not None:
        batch.on_expert_rows(layer, rows, spans, [(w.experts[e].gate_proj.module, w.experts[e].up_proj.module)
                                                   for e, _, _ in spans], len(w.experts))
    n_rows = rows_q.shape[0]
    inter = w.experts[spans[0][0]].gate_proj.out_features if spans else 0
    gate = rows_q.new_empty(n_rows, inter)
    up = rows_q.new_empty(n_rows, inter)
    gq = uq = None
    if xq is None and any(w.experts[e].gate_proj.input_quantizer() is not None for e, _, _ in spans):
        for e, a, b in spans:
            # gate and up not sharing one scale across the layer (not so under SGLang's loaders)
            ex = w.experts[e]
            gq = ex.gate_proj.quantize_input(rows[a:b])
            same = ex.up_proj.input_quantizer() is ex.gate_proj.input_quantizer()
            uq = gq if same else ex.up_proj.quantize_input(rows[a:b])
            linear_rows(gq, ex.gate_proj.weight(), out=gate[a:b])
            linear_rows(uq, ex.up_proj.weight(), out=up[a:b])
    else:
        _expert_products(rows_q, spans, [w.experts[e].gate_proj for e, _, _ in spans], gate)
        _expert_products(rows_q, spans, [w.experts[e].up_proj for e, _, _ in spans], up)
    if batch is None and observer is not None:
        for e, a, b in spans:
            ex = w.experts[e]
            x_seen = rows[a:b] if rows is not None else None
            notify_linear(observer, layer, ex.gate_proj.module, x_seen, gate[a:b], e)
            notify_linear(observer, layer, ex.up_proj.module, x_seen, up[a:b], e)
    # the loop's views keep the expert-sorted [T*k, hidden] buffers alive: drop them with their bases
    del rows, rows_q, gq, uq
    h = pointwise_rows(_swiglu, gate, up)
    del gate, up
    downs = [w.experts[e].down_proj for e, _, _ in spans]
    if batch is not None:
        batch.on_expert_rows(layer, h, spans, [(d.module,) for d in downs], len(w.experts))
    if not need_output and not observer_needs_outputs(observer):
        if batch is None:
            for (e, a, b), down in zip(spans, downs):
                notify_linear(observer, layer, down.module, h[a:b], None, e)
        return None

    if all(d.input_quantizer() is None for d in downs):
        hq = h
    elif shared_input_quantizer(downs) is not None:
        hq = downs[0].quantize_input(h)  # row-local: one call for all experts gives the same bits
    else:
        hq = torch.cat([d.quantize_input(h[a:b]) for (_, a, b), d in zip(spans, downs)])
    y = h.new_empty(n_rows, hidden)
    _expert_products(hq, spans, downs, y)
    if batch is None:
        for (e, a, b), down in zip(spans, downs):
            notify_linear(observer, layer, down.module, h[a:b], y[a:b], e)
    del h, hq
    if not need_output:
        return None
    # where each (token, slot) pair's row sits in the sorted buffer
    position = torch.empty_like(order)
    position[order] = torch.arange(order.numel(), device=order.device)
    position = position.view(T, k)
    out = torch.zeros(T, hidden, dtype=torch.float32, device=x.device)
    for j in range(k):
        out = out + y[position[:, j]].to(torch.float32) * weights[:, j, None]
    return out
