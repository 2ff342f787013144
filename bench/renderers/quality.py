"""Tables of accuracy and size: scale-selection methods, expert policies, the demo model's perplexity, and the
shared experts' precision (accuracy on the demo, bytes at K2.6 size)."""

from __future__ import annotations

from .common import (
    MISSING,
    BenchmarkRenderError,
    BlockContext,
    ResultFile,
    grouped,
    num,
    percent,
    provenance,
    renderer,
    table,
)

BASELINE_METHOD = "amax"  # Model Optimizer's rule: the reference each method's error is a multiple of
DEFAULT_METHOD = "int4-aware"
GB = 1e9
EXHAUSTIVE_METHOD = "sweep"  # every E4M3 block scale tried: the per-block optimum the default is held to


def _rows(result: ResultFile, key: str) -> list[dict]:
    result.require(key)
    rows = result.data[key]
    if not isinstance(rows, list) or not rows:
        raise BenchmarkRenderError(f"{result.path}: {key} is not a non-empty list")
    return rows


@renderer("scale_method_quality")
def scale_method_quality(ctx: BlockContext) -> str:
    """Relative weight MSE of each scale method against the exact INT4 values (bench.quality.scale_methods);
    the multiple of `amax` is taken within each result file."""
    parts = [provenance(ctx)]
    for r in ctx.results:
        methods = _rows(r, "results")
        baseline = next((m["rel_mse"] for m in methods if m["method"] == BASELINE_METHOD), None)
        threads = r.data.get("torch_threads")
        speed_header = f"Mparams/s ({r.data.get('device', 'device not recorded')}" + (
            f", {threads} thread{'s' if threads != 1 else ''})" if threads else ")"
        )
        rows = [
            [f"`{m['method']}`", num(m["rel_mse"], 5), num(m["rel_mse"] / baseline if baseline else None, 3),
             percent(m["exact_fraction"]), num(m["params_per_s"] / 1e6, 2)]
            for m in methods
        ]
        parts.append(f"`{r.path}` — {r.data.get('experts', MISSING)} expert(s) of {r.data.get('source', MISSING)}:")
        parts.append(table(["method", "rel MSE", f"x `{BASELINE_METHOD}` (same run)", "codes exact", speed_header],
                           rows))
        by_name = {m["method"]: m["rel_mse"] for m in methods}
        if DEFAULT_METHOD in by_name and EXHAUSTIVE_METHOD in by_name:
            parts.append(f"`{DEFAULT_METHOD}` / `{EXHAUSTIVE_METHOD}` (the exhaustive per-block optimum) rel MSE in "
                         f"this run: {by_name[DEFAULT_METHOD] / by_name[EXHAUSTIVE_METHOD]:.4f}.")
    return "\n\n".join(parts)


@renderer("expert_policy_comparison")
def expert_policy_comparison(ctx: BlockContext) -> str:
    """W4A4 KL/top-1 of each under-covered-expert policy under each SGLang input-scale reduction
    (bench.speed.calibrate --compare-policies)."""
    rows = []
    for r in ctx.results:
        for row in _rows(r, "rows"):
            rows.append([
                f"`{row['policy']}`", f"`{row['reduction']}`", num(row["kl_mean"], 4), num(row["kl_p99"], 3),
                num(row["top1"], 3), num(row["ppl_ratio"], 4), f"{row['experts_below_min']} / {row['experts_total']}",
                num(row.get("calibration_seconds"), 1),
            ])
    headers = ["policy", "input-scale reduction", "W4A4 KL mean", "W4A4 KL p99", "top-1", "perplexity ratio",
               "experts below min tokens", "calibrate s"]
    return "\n\n".join([provenance(ctx), table(headers, rows)])


@renderer("shared_experts_accuracy")
def shared_experts_accuracy(ctx: BlockContext) -> str:
    """KL/top-1 against the INT4 source per `--shared-experts` option on the demo model
    (bench.experiments.shared_experts.accuracy)."""
    rows = []
    for r in ctx.results:
        for row in _rows(r, "rows"):
            cells = [f"`{row['shared_experts']}`"]
            for mode in ("w4a16", "w4a4"):
                e = row.get(mode)
                cells += ([f"{e['kl_mean']:.4f} / {e['kl_p99']:.3f}", num(e["top1"], 3)] if e else [MISSING, MISSING])
            cells += ["pass" if row["passed"] else "fail", grouped(row["checkpoint_tensor_bytes"])]
            rows.append(cells)
    headers = ["shared experts", "W4A16 KL mean / p99", "W4A16 top-1", "W4A4 KL mean / p99", "W4A4 top-1",
               "validate gates", "checkpoint tensor bytes"]
    return "\n\n".join([provenance(ctx), table(headers, rows)])


@renderer("demo_model_perplexity")
def demo_model_perplexity(ctx: BlockContext) -> str:
    """Held-out perplexity of the demo model in float32 and read back from its INT4 checkpoint
    (`kimi-nvfp4 build-demo-model` writes training_report.json next to the checkpoint)."""
    parts = [provenance(ctx)]
    for r in ctx.results:
        r.require("perplexity", "parameters", "train")
        ppl, train = r.data["perplexity"], r.data["train"]
        rows = []
        for split, what in (("code", "stdlib code it never saw"), ("chat", "agent chats")):
            f32, int4 = ppl.get(f"float32_{split}"), ppl.get(f"int4_checkpoint_{split}")
            if f32 is None or int4 is None:
                continue
            rows.append([f"{what} ({grouped(f32['tokens'])} tokens)", num(f32["ppl"]), num(int4["ppl"])])
        if not rows:
            raise BenchmarkRenderError(f"{r.path}: perplexity records no float32_/int4_checkpoint_ pair")
        parts.append(
            f"{grouped(r.data['parameters'])} parameters; {train['settings']['steps']} steps, "
            f"{grouped(train['tokens_seen'])} tokens seen in {train['seconds']:.0f} s of training on "
            f"{train.get('device', MISSING)}."
        )
        parts.append(table(["held-out perplexity", "float32", "INT4 checkpoint read back"], rows))
    return "\n\n".join(parts)


@renderer("shared_expert_bytes")
def shared_expert_bytes(ctx: BlockContext) -> str:
    """Checkpoint and per-token read bytes with BF16 vs NVFP4 shared experts at K2.6 size
    (bench/experiments/shared_experts/bytes.py: arithmetic from the config, labelled as such)."""
    parts = [provenance(ctx)]
    for r in ctx.results:
        r.require("shared_experts_bytes", "per_token_read_bytes", "per_token_read_bytes_parts", "kind")
        shared, per_token = r.data["shared_experts_bytes"], r.data["per_token_read_bytes"]
        saved = shared["bf16"] - shared["nvfp4"]
        reference = r.data.get("reference_checkpoint_bytes")
        share = f", {percent(saved / reference)} of {reference / GB:.0f} GB" if reference else ""
        rows = [
            ["shared-expert bytes in the checkpoint", f"{shared['bf16'] / GB:.3f} GB",
             f"{shared['nvfp4'] / GB:.3f} GB (−{saved / GB:.2f} GB{share})"],
            ["bytes a decode step reads per token at batch 1", f"{per_token['bf16'] / GB:.2f} GB",
             f"{per_token['nvfp4'] / GB:.2f} GB (−{percent(1 - per_token['nvfp4'] / per_token['bf16'])})"],
        ]
        parts.append(f"**{r.data['kind']}** (`{r.path}`):")
        parts.append(table(["", "shared experts BF16", "shared experts NVFP4"], rows))
        parts.append("Per-token parts besides the shared experts: " + ", ".join(
            f"{name.replace('_', ' ')} {value / GB:.2f} GB" for name, value in r.data["per_token_read_bytes_parts"].items()
        ) + ".")
    return "\n\n".join(parts)


KV_VARIANTS = {  # bench.quality.kv_cache_scales's variants, in the order the table shows them
    "bf16-cache": "unquantized (reference)",
    "fp8-scale-1": "FP8, scale 1.0 (SGLang with no scales shipped)",
    "fp8-written": "FP8, the scales calibrate writes",
    "fp8-amax-over-448": "FP8, amax / 448 applied on write and read (an engine that honours any scale)",
    "sglang-unclamped": "SGLang 0.5.23 MLA decode with an unclamped amax / 448 in the checkpoint "
                        "(cache cast unscaled, scores x k_scale)",
}


@renderer("kv_cache_scales")
def kv_cache_scales(ctx: BlockContext) -> str:
    """What calibrate measures and writes per layer for the FP8 KV cache, and what each cache variant costs in
    token-by-token decode against an unquantized cache (bench.quality.kv_cache_scales)."""
    parts = [provenance(ctx)]
    for r in ctx.results:
        r.require("kv_cache", "rows")
        kv = r.data["kv_cache"]
        layers = kv.get("layers") or []
        parts.append(f"`{r.path}` — rule `{kv.get('rule', MISSING)}`, per layer:")
        parts.append(table(
            ["layer", "latent amax", "rope-key amax", "amax / 448", "written k_scale = v_scale"],
            [[str(l["layer"]), num(l["latent_amax"], 2), num(l["rope_amax"], 2), num(l["unclamped_scale"], 4),
              num(l["scale"], 4)] for l in layers],
        ))
        rows = _rows(r, "rows")
        heldout = r.data.get("heldout", {})
        parts.append(f"Decode of {heldout.get('samples', MISSING)} held-out windows ({heldout.get('tokens', MISSING)} "
                     f"tokens) against the same decode over an unquantized cache:")
        parts.append(table(
            ["cache", "KL mean", "KL p99", "top-1 vs unquantized cache", "perplexity"],
            [[KV_VARIANTS.get(row["variant"], f"`{row['variant']}`"), num(row["kl_mean"], 4), num(row["kl_p99"], 3),
              num(row["top1"], 3), num(row["ppl"], 2)] for row in rows],
        ))
    return "\n\n".join(parts)


def _spread(entry: dict, digits: int) -> str:
    return f"{num(entry['mean'], digits)} ({num(entry['min'], digits)}–{num(entry['max'], digits)})"


@renderer("requantize_accuracy")
def requantize_accuracy(ctx: BlockContext) -> str:
    """Validate's end-to-end figures per scale method over several held-out draws (bench.quality.requantize_accuracy);
    the multiple of `amax` is taken within each result file."""
    parts = [provenance(ctx)]
    for r in ctx.results:
        summary = _rows(r, "summary")
        base = next((m for m in summary if m["method"] == BASELINE_METHOD), None)

        def ratio(m: dict, key: str) -> str:
            return num(m[key]["mean"] / base[key]["mean"], 2, "x") if base else MISSING

        seeds = summary[0].get("seeds", [])
        parts.append(f"`{r.path}` — held-out draws (seeds) {', '.join(map(str, seeds))}; mean (min–max) over the draws:")
        parts.append(table(
            ["method", "KL W4A16", f"x `{BASELINE_METHOD}`", "KL W4A4", f"x `{BASELINE_METHOD}`", "top-1 W4A16",
             "top-1 W4A4"],
            [[f"`{m['method']}`", _spread(m["w4a16.kl_mean"], 4), ratio(m, "w4a16.kl_mean"), _spread(m["w4a4.kl_mean"], 4),
              ratio(m, "w4a4.kl_mean"), num(m["w4a16.top1"]["mean"], 3), num(m["w4a4.top1"]["mean"], 3)]
             for m in summary],
        ))
    return "\n\n".join(parts)
