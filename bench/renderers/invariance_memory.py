"""Batch invariance (bench.quality.batch_invariance, bench.quality.statistics_invariance) and the memory planner against the
measured peak (bench.profile.memory_plan)."""

from __future__ import annotations

from .common import BlockContext, num, provenance, renderer, table

GIB = 2**30


@renderer("batch_invariance_cost")
def batch_invariance_cost(ctx: BlockContext) -> str:
    """One row per (file, mode): time per layer forward with and without batch-invariant products, and how far two
    cuts of the same tokens land apart in each."""
    rows = []
    for r in ctx.results:
        r.require("results")
        by_mode: dict[str, dict[bool, dict]] = {}
        for row in r.data["results"]:
            by_mode.setdefault(row["mode"], {})[row["invariant"]] = row
        for mode, pair in by_mode.items():
            off, on = pair.get(False), pair.get(True)
            if off is None or on is None:
                continue
            rows.append([f"{on['device']} {on['dtype']}", f"{on['experts']} experts, {on['tokens']:,} tokens", mode,
                         num(off["seconds"], 3), num(on["seconds"], 3), num(on["seconds"] / off["seconds"], 2, "x"),
                         f"{off['rows_differing_between_cuts']:,} ({off['rel_norm_difference_between_cuts']:.1e})",
                         f"{on['rows_differing_between_cuts']:,}"])
    headers = ["device", "layer", "mode", "plain s", "invariant s", "invariant / plain",
               "plain: rows differing between two cuts (relative norm)", "invariant: rows differing"]
    return "\n\n".join([provenance(ctx), table(headers, rows)])


@renderer("statistics_invariance")
def statistics_invariance(ctx: BlockContext) -> str:
    rows = []
    for r in ctx.results:
        r.require("statistics_tensors", "statistics_tensors_differing", "expert_weight_bytes_differing")
        d = r.data
        rows.append([f"{d['samples']} x {d['seq_len']}", f"default vs {d['other_chunk']}",
                     "yes" if d["input_scales_identical"] else "no",
                     f"{d['statistics_tensors_differing']} of {d['statistics_tensors']}",
                     f"{d['statistics_max_relative_difference']:.1e}",
                     f"{d['expert_weight_bytes_differing']:,} of {d['expert_weight_bytes']:,}"])
    headers = ["calibration tokens", "MoE chunk tokens", "input scales bit-identical", "statistics tensors differing",
               "largest relative difference", "gptq expert bytes differing"]
    return "\n\n".join([provenance(ctx), table(headers, rows)])


@renderer("memory_plan_vs_measured")
def memory_plan_vs_measured(ctx: BlockContext) -> str:
    """One row per case: the plan's choices, its estimate, the measured peaks, the time per MoE layer."""
    rows = []
    for r in ctx.results:
        r.require("results", "gpu")
        for row in r.data["results"]:
            plan = row["plan"]
            oom = row.get("out_of_memory")
            est = plan["estimated_peak_gpu_bytes"]
            rows.append([
                r.stem, row["stage"], f"{row['samples']} x {row['seq_len']}", row.get("cap") or "free",
                "host (pinned)" if plan["states_device"] == "cpu" else "GPU", f"{plan['chunk_tokens']:,}",
                "yes" if plan["materialize"] else "no", "yes" if plan["prefetch"] else "no", num(est / GIB, 1),
                num(row["peak_allocated_bytes"] / GIB, 1), num(row["peak_allocated_bytes"] / est, 2),
                num(row["peak_reserved_bytes"] / GIB, 1),
                "OOM" if oom else " / ".join(num(s, 1) for s in row.get("moe_layer_seconds", [])),
            ])
    headers = ["file", "stage", "tokens", "GPU budget", "states", "chunk", "dequantized once", "prefetch",
               "estimate GiB", "allocated GiB", "allocated / estimate", "reserved GiB", "s per MoE layer"]
    return "\n\n".join([provenance(ctx), table(headers, rows)])
