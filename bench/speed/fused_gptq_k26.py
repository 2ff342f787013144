"""calibrate alone against calibrate --method gptq (fused, expert groups planned by the memory planner) on a
K2.6-shaped checkpoint (layer 0 dense, then MoE layers of 384 experts, hidden 7168), at the CLI's defaults
(512 x 2048 tokens of builtin sessions, the plan the stage makes), in the same run on the same converted folder:
wall time of each, the per-MoE-layer cost of the method, its memory plan (expert groups, solve batch) and the
peak GPU memory allocated.

    python -m bench.speed.fused_gptq_k26 --work-dir /tmp/kimi_fused --json bench/results/fused_gptq_k26_h200.json

The whole-K2.6 figures it prints are projections: 60 MoE layers at the measured per-MoE-layer cost.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch

from bench.harness.k26_checkpoint import H200_BF16_MEASURED_TFLOPS, K26_LAYERS, K26_DENSE_LAYERS, prepare
from bench.harness.results import bench_parser, write_result
from kimi_nvfp4.calibrate import calibrate_checkpoint
from kimi_nvfp4.checkpoint.manifest import load_manifest


def _run(out: Path, src: Path, args, **method) -> dict:
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    report = calibrate_checkpoint(out, src, args.data, samples=args.samples, seq_len=args.seq_len,
                                  device=args.device, progress=False, **method)
    seconds = time.perf_counter() - t
    row = {"seconds": round(seconds, 2), "tokens": report.tokens,
           "peak_gpu_allocated_bytes": torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None,
           "memory_plan": report.memory_plan.model_dump(mode="json") if report.memory_plan else None}
    for key in ("layer_seconds", "phase_seconds"):
        if getattr(report, key, None) is not None:
            row[key] = getattr(report, key)
    return row


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/kimi_fused"))
    parser.add_argument("--layers", type=int, default=2, help="decoder layers (layer 0 dense, the rest MoE)")
    parser.add_argument("--experts", type=int, default=384)
    parser.add_argument("--vocab-size", type=int, default=None)
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--data", default="builtin")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--synth-device", default="cuda")
    parser.add_argument("--skip-plain", action="store_true", help="time only calibrate --method gptq")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    args.work_dir.mkdir(parents=True, exist_ok=True)
    src, out = prepare(args.work_dir, "k2.6", args.layers, args.device, args.experts, args.vocab_size,
                       args.synth_device)
    rows = {}
    if not args.skip_plain:
        rows["calibrate"] = _run(out, src, args)
        print(json.dumps({"calibrate_s": rows["calibrate"]["seconds"]}), flush=True)
    from kimi_nvfp4.calibrate.memory import plan_calibration

    plan = plan_calibration(out, samples=args.samples, seq_len=args.seq_len, device=args.device, method="gptq")
    print("plan for calibrate --method gptq:", plan.summary(), json.dumps(plan.components), flush=True)
    rows["calibrate_gptq"] = _run(out, src, args, method="gptq")
    record = load_manifest(out).stages["calibrate"].outputs.get("fused_method")
    moe_layers = args.layers - K26_DENSE_LAYERS
    result = {"checkpoint": f"synthetic K2.6 shapes, {args.layers} layers, {args.experts} experts",
              "samples": args.samples, "seq_len": args.seq_len, "data": args.data, "fused_record": record, **rows}
    if "calibrate" in rows:
        extra = rows["calibrate_gptq"]["seconds"] - rows["calibrate"]["seconds"]
        per_layer = extra / moe_layers
        result["gptq_extra_s_per_moe_layer"] = round(per_layer, 2)
        result["projection_whole_k26_gptq_extra_min"] = {
            "value": round(per_layer * (K26_LAYERS - K26_DENSE_LAYERS) / 60, 1),
            "extrapolates": f"the measured extra seconds per MoE layer x {K26_LAYERS - K26_DENSE_LAYERS} MoE layers"}
        result["ratio_gptq_to_calibrate"] = round(rows["calibrate_gptq"]["seconds"] / rows["calibrate"]["seconds"], 2)
    result["h200_bf16_reference_tflops"] = H200_BF16_MEASURED_TFLOPS
    print(json.dumps(write_result(args.json, result, device=args.device), indent=2, default=str))


if __name__ == "__main__":
    main()
