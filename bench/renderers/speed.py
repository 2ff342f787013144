"""Tables of speed benchmarks: the reference model (bench.speed.model_layer) and convert against its peer
(bench.speed.convert)."""

from __future__ import annotations

from .common import MISSING, BenchmarkRenderError, BlockContext, grouped, num, provenance, renderer, table

GIB = 2**30
GB = 1e9


@renderer("reference_model_speed")
def reference_model_speed(ctx: BlockContext) -> str:
    """Tokens/s and peak memory of the reference model per case and mode (bench.speed.model_layer)."""
    rows = []
    for r in ctx.results:
        r.require("results")
        for case in r.data["results"]:
            rows.append([
                f"`{case['case']}`", f"`{case['mode']}`", str(case["tokens"]), str(case["seq_len"]),
                str(case["experts"]), num(case["seconds"]), grouped(round(case["tokens_per_s"])),
                num(case["peak_memory_bytes"] / GIB if case.get("peak_memory_bytes") is not None else None),
            ])
    headers = ["case", "mode", "tokens", "tokens per sequence", "experts", "seconds", "tokens/s", "peak memory GiB"]
    return "\n\n".join([provenance(ctx), table(headers, rows)])


@renderer("convert_vs_peer")
def convert_vs_peer(ctx: BlockContext) -> str:
    """Our conversion against llm-compressor's model_free_ptq, both measured in the same bench.speed.convert run
    on the same checkpoint. The ratios are taken between figures of one result file; a file without the peer's
    figures (`--skip-peer`, or the peer failed) shows no ratio at all."""
    parts = [provenance(ctx)]
    for r in ctx.results:
        r.require("ours", "int4_bytes", "tensor_bytes", "baseline_rss_bytes")
        d = r.data
        peer = d.get("peer") if isinstance(d.get("peer"), dict) and "seconds" in d["peer"] else None
        base = d["baseline_rss_bytes"]
        rows = []
        for name, ours in d["ours"].items():
            if ours.get("seconds") is None or ours.get("peak_rss_bytes") is None:
                raise BenchmarkRenderError(f"{r.path}: ours[{name!r}] lacks seconds or peak_rss_bytes")
            row = [f"`{name}`", num(ours["seconds"]), num(d["int4_bytes"] / GB / ours["seconds"], 3),
                   num(d["tensor_bytes"] / GB / ours["seconds"], 3), num(ours["peak_rss_bytes"] / GB)]
            if peer:
                row += [num(peer["seconds"] / ours["seconds"], 2),
                        num((ours["peak_rss_bytes"] - base) / max(1, peer["peak_rss_bytes"] - base), 2)]
            rows.append(row)
        headers = ["ours", "seconds", "INT4 GB/s", "all tensors GB/s", "peak RSS GB"]
        if peer:
            headers += ["speed x peer (same run)", "peak RSS / peer's, net of import (same run)"]
            rows.append(["llm-compressor `model_free_ptq`", num(peer["seconds"]),
                         num(d["int4_bytes"] / GB / peer["seconds"], 3), num(d["tensor_bytes"] / GB / peer["seconds"], 3),
                         num(peer["peak_rss_bytes"] / GB), MISSING, MISSING])
        summary = (f"`{r.path}` — {d.get('layers', MISSING)} layers x {d.get('experts', MISSING)} experts, "
                   f"{d['int4_bytes'] / GB:.3f} GB INT4 of {d['tensor_bytes'] / GB:.3f} GB, "
                   f"{d.get('workers', MISSING)} worker(s)")
        if not peer:
            reason = d["peer"].get("error", "the peer failed") if isinstance(d.get("peer"), dict) else "not run"
            summary += f"; peer not measured in this run ({reason}), so no ratio is shown"
        parts += [summary + ":", table(headers, rows)]
    return "\n\n".join(parts)
