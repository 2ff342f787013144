"""The output-aware scale methods on K2.6-dimension expert matrices (bench.quality.output_aware)."""

from __future__ import annotations

from .common import BlockContext, num, provenance, renderer, table

INPUT_KINDS = {"gate_up": "gate/up (reads the hidden state, 7168 wide)", "down": "down (reads the SwiGLU output, 2048 wide)"}


@renderer("output_aware_k26_matrices")
def output_aware_k26_matrices(ctx: BlockContext) -> str:
    """Per input kind and method: the held-out relative output error and its ratio to int4-aware and to amax, the
    calibration-weighted error ratio the methods minimise, and seconds per matrix."""
    rows = []
    for r in ctx.results:
        r.require("summary", "device")
        # a --rows run times part of each matrix: its layer figure would be a guess, so it shows none
        whole = "--rows" not in str(r.data.get("command", ""))
        clock = "wall s" if "cpu" not in str(r.data["device"]).lower() else "CPU s"
        for kind, methods in r.data["summary"].items():
            for method, m in methods.items():
                layer = r.data.get("results", {}).get(kind, {}).get(method, {}).get("seconds_per_384_expert_layer")
                rows.append([
                    f"`{r.stem}`", INPUT_KINDS.get(kind, kind), f"`{method}`", f"{m['held_out_relative_error']:.5f}",
                    num(m["held_out_relative_error_vs_int4-aware"], 3), num(m["held_out_relative_error_vs_amax"], 3),
                    num(m["weighted_error_dense_vs_int4-aware"], 3),
                    f"{num(m['seconds_per_matrix'], 3)} ({clock})", num(layer if whole else None, 1),
                ])
    headers = ["run", "matrix", "method", "held-out relative output error", "vs int4-aware", "vs amax",
               "calibration-weighted error vs int4-aware", "s per matrix", "s per 384-expert layer"]
    return "\n\n".join([provenance(ctx), table(headers, rows)])


@renderer("w4a4_layer_error")
def w4a4_layer_error(ctx: BlockContext) -> str:
    """Per input kind and method (bench.experiments.w4a4_floor.layer_error): the served (W4A4) and W4A16 layer-local errors as a
    multiple of int4-aware's, under the statistics the methods were fitted on and under other tokens'."""
    parts = [provenance(ctx)]
    for r in ctx.results:
        r.require("rows", "settings")
        ratio = {(x["statistics"], x["input"], x["mode"], x["method"]): x["vs_int4_aware"] for x in r.data["rows"]}
        methods = list(dict.fromkeys(x["method"] for x in r.data["rows"]))
        inputs = list(dict.fromkeys(x["input"] for x in r.data["rows"]))
        s = r.data["settings"]
        parts.append(f"`{r.path}` — statistics of calibrate seed {s['fitted_seed']} (fitted on) and seed "
                     f"{s['other_seed']} ({s['samples']} × {s['seq_len']} tokens each, {s['sequences_shared']} "
                     "sequences shared); summed error over the experts with dense statistics, multiple of int4-aware's:")
        rows = [[f"`{m}`", *(num(ratio.get((which, g, mode, m)), 3) for g in inputs for mode in ("w4a4", "w4a16")
                             for which in ("in-sample", "other tokens"))] for m in methods]
        headers = ["method", *(f"{g} {mode.upper()} {which}" for g in inputs for mode in ("w4a4", "w4a16")
                               for which in ("in-sample", "other tokens"))]
        parts.append(table(headers, rows))
    return "\n\n".join(parts)


@renderer("gptq_solver_timing")
def gptq_solver_timing(ctx: BlockContext) -> str:
    """bench/profile/gptq.py: the batched GPTQ solver alone at K2.6 shapes (one batch of experts of one input kind),
    wall seconds for the factor (the inverse-Hessian factor before the one-factor solver, the Cholesky factor since)
    and the whole solve, per expert and scaled to 384 experts."""
    rows = []
    for r in ctx.results:
        r.require("kind", "experts", "factor_s", "gptq_quantize_s", "s_per_expert", "projected_s_per_384_experts")
        d = r.data
        rows.append([f"`{r.stem}`", INPUT_KINDS.get(d["kind"], d["kind"]), str(d["experts"]),
                     f"`{str(d.get('git_commit', ''))[:7]}`", num(d["factor_s"], 3), num(d["gptq_quantize_s"], 3),
                     num(d["s_per_expert"], 4), num(d["projected_s_per_384_experts"], 1)])
    headers = ["run", "matrix", "experts per batch", "commit", "factor s", "solve s (with factor)", "s per expert",
               "s per 384 experts (projection)"]
    return "\n\n".join([provenance(ctx), table(headers, rows)])
