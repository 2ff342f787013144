"""Benchmark calibration on K2.6-shaped layers and project the whole-model time.

Builds (or reuses) a synthetic K2.6-shaped INT4 checkpoint with `--layers` decoder layers (layer 0
dense, the rest MoE with 384 experts x 2048, hidden 7168), converts it, then times the calibrate
layer loop (one load + one attention per layer; observe W4A16 statistics + advance W4A4 per MoE layer)
over `--samples` x `--seq-len` tokens, in `--dtype` (auto: bf16 on CUDA, fp32 on CPU).
Projection for Kimi K2.6: first_k_dense_replace dense layers + 60 MoE layers at the measured
per-layer times. Writes JSON (and prints a table); run on the H200 with `--device cuda`:

    python -m bench.speed.calibrate --device cuda --work-dir /tmp/kimi_bench --json bench_calibrate.json

A CPU smoke run (tiny sizes; the synthetic checkpoint takes ~20 s per GB to write):

    python -m bench.speed.calibrate --device cpu --layers 2 --experts 4 --vocab-size 4096 --samples 2 \
        --seq-len 128 --work-dir /tmp/kimi_bench_cpu --json /tmp/bench_calibrate_cpu.json

Tokens are random ids by default (routing on synthetic weights is arbitrary anyway); `--data SPEC`
renders real sessions with the synthetic checkpoint's tokenizer instead.

`--compare-policies` instead measures the under-covered-expert policies on the bundled demo model:
calibrate with each policy, then validate (W4A4, held-out sessions) under both SGLang input-scale
reductions, and report KL / top-1 / perplexity for each (how the default policy was chosen):

    python -m bench.speed.calibrate --compare-policies --device cpu --data builtin --samples 4 \
        --seq-len 256 --min-expert-tokens 64 --validate-samples 16 --json policies.json
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from kimi_nvfp4.calibrate import ExpertPolicy
from kimi_nvfp4.calibrate.api import run_calibration
from kimi_nvfp4.stage_kit.device import resolve_device
from kimi_nvfp4.checkpoint.reader import CheckpointReader
from kimi_nvfp4.convert.api import convert_checkpoint
from kimi_nvfp4.stage_kit.layer_memory import peak_allocated, reset_peak

from bench.harness.k26_checkpoint import (
    H200_BF16_MEASURED_TFLOPS,
    K26_DENSE_LAYERS,
    K26_LAYERS,
    moe_layer_flops_per_token,
    prepare,
    sequences,
)
from bench.harness.provenance import provenance

def compare_policies(args, dev: torch.device) -> dict:
    import shutil

    from kimi_nvfp4.calibrate import calibrate_checkpoint
    from kimi_nvfp4.demo_model import DEMO_CHECKPOINT
    from kimi_nvfp4.validate import validate_checkpoint

    base = args.work_dir / "demo_nvfp4"
    if not (base / "kimi_nvfp4_manifest.json").exists():
        convert_checkpoint(DEMO_CHECKPOINT, base, device=str(dev), progress=False)
    data = args.data or "builtin"
    rows = []
    for policy in ExpertPolicy:
        out = args.work_dir / f"demo_{policy.value}"
        shutil.rmtree(out, ignore_errors=True)
        shutil.copytree(base, out)
        t = time.perf_counter()
        cal = calibrate_checkpoint(
            out,
            DEMO_CHECKPOINT,
            data,
            samples=args.samples,
            seq_len=args.seq_len,
            seed=args.seed,
            min_expert_tokens=args.min_expert_tokens,
            policy=policy,
            device=dev,
            dtype=args.dtype,
            progress=False,
        )
        cal_seconds = time.perf_counter() - t
        moe = [l for l in cal.layers if l.experts is not None]
        for reduction in ("layer_max", "per_expert"):
            v = validate_checkpoint(
                out,
                DEMO_CHECKPOINT,
                data,
                report_dir=out / f"validate_{reduction}",
                modes=("w4a4",),
                samples=args.validate_samples,
                seq_len=args.seq_len,
                device=dev,
                input_scale_reduction=reduction,
                progress=False,
                record_in_manifest=False,
            )
            e = v.end_to_end[0]
            rows.append(
                {
                    "policy": policy.value,
                    "reduction": reduction,
                    "calibration_dtype": cal.settings.dtype,
                    "calibration_tokens": cal.tokens,
                    "calibration_seconds": cal_seconds,
                    "experts_below_min": sum(l.experts_below_min_tokens for l in moe),
                    "experts_total": sum(len(l.experts.tokens) for l in moe),
                    "kl_mean": e.kl_mean,
                    "kl_p99": e.kl_p99,
                    "top1": e.top1,
                    "ppl_ratio": e.ppl_ratio,
                    "drift_max": max(l.drift.get("w4a4", 0.0) for l in v.layers),
                    "heldout_tokens": v.tokens,
                }
            )
            print(json.dumps(rows[-1]))
    return {
        "device": str(dev),
        "model": "demo (kimi_nvfp4/assets/tiny_k2)",
        "data": data,
        "samples": args.samples,
        "seq_len": args.seq_len,
        "min_expert_tokens": args.min_expert_tokens,
        "validate_samples": args.validate_samples,
        "rows": rows,
        **provenance(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--work-dir", type=Path, default=Path("/tmp/kimi_nvfp4_bench"))
    ap.add_argument(
        "--preset", default="k2.6", help="synthetic preset (k2.6 = real K2.6 dimensions; tiny for a smoke run)"
    )
    ap.add_argument("--layers", type=int, default=2, help="decoder layers to build (layer 0 dense, rest MoE)")
    ap.add_argument("--experts", type=int, default=None, help="routed experts per MoE layer (default: the preset's)")
    ap.add_argument("--vocab-size", type=int, default=None, help="smaller vocab for a faster synthetic checkpoint")
    ap.add_argument("--samples", type=int, default=512)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--policy", default=ExpertPolicy.PEER_MAX.value, choices=[p.value for p in ExpertPolicy])
    ap.add_argument("--min-expert-tokens", type=int, default=32)
    ap.add_argument("--max-chunk-tokens", type=int, default=None,
                    help="tokens per MLP/MoE chunk (default: 65536 on CUDA, 16384 on CPU)")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                    help="compute dtype (auto: bfloat16 on CUDA, float32 on CPU)")
    ap.add_argument("--materialize", default="auto", choices=["auto", "on", "off"],
                    help="dequantize each layer once (auto: on CUDA when it fits) or per chunk")
    ap.add_argument("--prefetch", choices=["auto", "on", "off"], default="auto",
                    help="load layer L+1 while layer L computes (auto: on CUDA)")
    ap.add_argument("--states-device", default=None)
    ap.add_argument("--data", default=None, help="render real sessions (calibrate --data spec) instead of random ids")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--synth-device", default="cpu", help="where the synthetic checkpoint is generated (cuda: fast)")
    ap.add_argument("--json", type=Path, default=Path("bench_calibrate.json"))
    ap.add_argument("--label", default=None, help="what this run measures (the row's name in docs/benchmarks.md)")
    ap.add_argument("--compare-policies", action="store_true", help="peer-max vs route-all on the demo model")
    ap.add_argument("--validate-samples", type=int, default=64, help="held-out sequences for --compare-policies")
    args = ap.parse_args()

    dev = resolve_device(args.device)
    args.work_dir.mkdir(parents=True, exist_ok=True)
    if args.compare_policies:
        args.json.write_text(json.dumps(compare_policies(args, dev), indent=2) + "\n")
        return
    _src, out = prepare(
        args.work_dir, args.preset, args.layers, str(dev), args.experts, args.vocab_size, args.synth_device
    )
    reader = CheckpointReader(out)
    cfg = reader.layout.text
    seqs = sequences(reader, out, args.samples, args.seq_len, args.data, args.seed)
    tokens = sum(int(s.numel()) for s in seqs)
    if dev.type == "cuda":
        reset_peak(dev)
    t = time.perf_counter()
    run = run_calibration(
        reader,
        seqs,
        policy=ExpertPolicy(args.policy),
        min_expert_tokens=args.min_expert_tokens,
        device=dev,
        max_chunk_tokens=args.max_chunk_tokens,
        states_device=args.states_device,
        dtype=args.dtype,
        materialize={"auto": "auto", "on": True, "off": False}[args.materialize],
        prefetch={"auto": None, "on": True, "off": False}[args.prefetch],
    )
    total = time.perf_counter() - t
    dense = [s for i, s in enumerate(run.layer_seconds) if not cfg.is_moe_layer(i)]
    moe = [s for i, s in enumerate(run.layer_seconds) if cfg.is_moe_layer(i)]
    per_moe = sum(moe) / len(moe) if moe else 0.0
    per_dense = sum(dense) / len(dense) if dense else 0.0
    projected = K26_DENSE_LAYERS * per_dense + (K26_LAYERS - K26_DENSE_LAYERS) * per_moe
    result = {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu",
        "preset": args.preset,
        "hidden_size": cfg.hidden_size,
        "experts": cfg.n_routed_experts,
        "samples": len(seqs),
        "seq_len": args.seq_len,
        "tokens": tokens,
        "policy": args.policy,
        "dtype": run.dtype,
        "max_chunk_tokens": run.max_chunk_tokens,
        "materialize": args.materialize,
        "materialized_layers": run.materialized_layers,
        "prefetch": args.prefetch,
        "states_device": args.states_device,
        "layer_seconds": run.layer_seconds,
        "phase_seconds": run.phase_seconds,
        "dense_layer_seconds": per_dense,
        "moe_layer_seconds": per_moe,
        "moe_layer_tokens_per_second": tokens / per_moe if per_moe else None,
        "total_seconds": total,
        "projected_k26_61_layers_seconds": projected,
        "projected_k26_61_layers_minutes": projected / 60,
        # Layer time is linear in tokens (no attention over >seq_len); scale to the 512 x 2048.
        "projected_k26_61_layers_512x2048_minutes": projected / 60 * (512 * 2048) / tokens,
        "goal_minutes": 10,
        # two MLP passes per MoE layer (observe W4A16 without down_proj's output, advance W4A4) + one attention
        "moe_layer_model_tflops_per_s": (
            tokens * moe_layer_flops_per_token(cfg, args.seq_len) * 2 / per_moe / 1e12 if per_moe else None
        ),
        "fraction_of_bf16_peak": (
            tokens * moe_layer_flops_per_token(cfg, args.seq_len) * 2 / per_moe / 1e12 / H200_BF16_MEASURED_TFLOPS
            if per_moe and dev.type == "cuda" else None
        ),
        "peak_gpu_memory_gib": peak_allocated(dev) / 2**30 if dev.type == "cuda" else None,
        "bf16_peak_tflops": H200_BF16_MEASURED_TFLOPS if dev.type == "cuda" else None,
        "projection_from": f"{len(run.layer_seconds)} synthetic layers x {len(seqs)} sequences x {args.seq_len} tokens",
        "label": args.label,
        **provenance(),
    }
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "layer_seconds"}, indent=2))


if __name__ == "__main__":
    main()
