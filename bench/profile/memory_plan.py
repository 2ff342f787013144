"""The memory planner against the measured peak: calibrate and validate on K2.6-shaped layers at 96, 256 and 512
sequences of 2048 tokens, at the GPU's own memory and under 80 GiB and 48 GiB caps.

Builds (or reuses) a synthetic K2.6-shaped checkpoint (`--layers`, default 3: one dense layer and two MoE layers of
384 experts, so the next layer's prefetch is part of the peak) and converts it. Each case plans exactly as the
stage does (`plan_stage`), holds the process to the cap (`apply_gpu_cap`), runs the stage's layer loop with the
plan's settings on random token ids, and records the estimated and the measured peak (`max_memory_allocated`, and
`max_memory_reserved`, what the caching allocator took from the GPU) with the time per MoE layer. A case that runs
out of memory is recorded as such. Results are written after every case.

    python -m bench.profile.memory_plan --work-dir /tmp/kimi_plan --json bench/results/memory_plan_h200.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from bench.harness.k26_checkpoint import prepare, sequences
from bench.harness.provenance import provenance
from kimi_nvfp4.calibrate import ExpertPolicy
from kimi_nvfp4.calibrate.api import run_calibration
from kimi_nvfp4.calibrate.options import CalibrateOptions
from kimi_nvfp4.calibrate.shard import INPUT_SCALES_SHARD, install_input_scales
from kimi_nvfp4.checkpoint.reader import CheckpointReader
from kimi_nvfp4.model.linear import ActivationMode
from kimi_nvfp4.model.nvfp4_linears import InputScaleReduction
from kimi_nvfp4.stage_kit.memory_plan import GIB, apply_gpu_cap, plan_stage
from kimi_nvfp4.validate import DEFAULT_GATES
from kimi_nvfp4.validate.streams import compare_streams
from kimi_nvfp4.validate.baseline import baseline_enabled
from kimi_nvfp4.validate.options import ValidateOptions
from kimi_nvfp4.stage_kit.layer_memory import peak_allocated, peak_reserved, reset_peak

# (stage, samples, cap): the defaults first, then the smaller sizes, then the caps
CASES = [("calibrate", 512, None), ("validate", 512, None), ("calibrate", 96, None), ("validate", 96, None),
         ("calibrate", 256, None), ("validate", 256, None), ("validate", 512, "80GiB"), ("validate", 512, "48GiB"),
         ("calibrate", 512, "80GiB"), ("calibrate", 512, "48GiB")]


def run_case(src: Path, out: Path, stage: str, samples: int, cap: str | None, seq_len: int) -> dict:
    dev = torch.device("cuda", 0)
    reader, src_reader = CheckpointReader(out), CheckpointReader(src)
    cfg = reader.layout.text
    seqs = sequences(reader, out, samples, seq_len, None, seed=samples)
    tokens = samples * seq_len
    torch.cuda.empty_cache()
    if hasattr(torch._C, "_host_emptyCache"):  # pinned host memory of the previous case (one plan per run)
        torch._C._host_emptyCache()
    torch.cuda.set_per_process_memory_fraction(1.0, 0)
    if stage == "calibrate":
        opts = CalibrateOptions(samples=samples, seq_len=seq_len, device="cuda", gpu_memory=cap)
        plan = plan_stage(cfg, opts, stage="calibrate", device=dev, dtype=torch.bfloat16, tokens=tokens, streams=1,
                          sources=1)
    else:
        opts = ValidateOptions(samples=samples, seq_len=seq_len, device="cuda", gpu_memory=cap)
        baseline = baseline_enabled(opts.baseline, tokens)
        plan = plan_stage(cfg, opts, stage="validate", device=dev, dtype=torch.bfloat16, tokens=tokens,
                          streams=1 + len(opts.modes) + int(baseline), sources=2, baseline=baseline)
    apply_gpu_cap(dev, opts.gpu_memory)
    reset_peak(dev)
    row = {"stage": stage, "samples": samples, "seq_len": seq_len, "cap": cap, "plan": plan.model_dump()}
    start = time.perf_counter()
    try:
        if stage == "calibrate":
            run = run_calibration(reader, seqs, policy=ExpertPolicy.PEER_MAX, min_expert_tokens=1, device=dev,
                                  max_chunk_tokens=plan.chunk_tokens, states_device=plan.states_device,
                                  materialize=plan.materialize, prefetch=plan.prefetch, progress=False)
            if INPUT_SCALES_SHARD not in set(reader.weight_map.values()):
                install_input_scales(out, run.scales, stage_settings={"bench": True})
            layer_seconds, phase_seconds = run.layer_seconds, run.phase_seconds
        else:
            result = compare_streams(src_reader, reader, seqs, modes=[ActivationMode(m) for m in opts.modes],
                                     reduction=InputScaleReduction.LAYER_MAX, device=dev,
                                     flag_rel_mse=DEFAULT_GATES.weight_rel_mse_max,
                                     max_chunk_tokens=plan.chunk_tokens, states_device=plan.states_device,
                                     prefetch=plan.prefetch, materialize=plan.materialize, baseline=baseline,
                                     progress=False)
            layer_seconds, phase_seconds = result.layer_seconds, result.phase_seconds
            row["logits_seconds"] = result.logits_seconds
            row["mode_errors"] = dict(result.mode_errors)  # a stream that stopped holds less: say which and why
        torch.cuda.synchronize(dev)
        row["out_of_memory"] = False
    except torch.OutOfMemoryError as e:
        row["out_of_memory"], layer_seconds, phase_seconds = str(e).splitlines()[0], [], []
    row["seconds"] = time.perf_counter() - start
    row["moe_layer_seconds"] = [s for i, s in enumerate(layer_seconds) if cfg.is_moe_layer(i)]
    # where a MoE layer's time goes (stage_kit/device.py PhaseClock): the speed goals' starting point
    row["moe_phase_seconds"] = [p for i, p in enumerate(phase_seconds) if cfg.is_moe_layer(i)]
    row["peak_allocated_bytes"] = peak_allocated(dev)
    row["peak_reserved_bytes"] = peak_reserved(dev)
    row["measured_over_estimate"] = row["peak_reserved_bytes"] / plan.estimated_peak_gpu_bytes
    torch.cuda.set_per_process_memory_fraction(1.0, 0)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work-dir", type=Path, default=Path("/tmp/kimi_plan"))
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--experts", type=int, default=None, help="routed experts per MoE layer (default: K2.6's 384)")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--case", action="append", default=None, help="STAGE:SAMPLES[:CAP], repeatable (default: all)")
    ap.add_argument("--json", type=Path, required=True)
    args = ap.parse_args()
    cases = CASES if not args.case else [
        (c.split(":")[0], int(c.split(":")[1]), (c.split(":") + [None])[2]) for c in args.case]
    args.work_dir.mkdir(parents=True, exist_ok=True)
    src, out = prepare(args.work_dir, "k2.6", args.layers, "cuda", args.experts, None, "cuda")
    head = {**provenance(), "device": torch.cuda.get_device_name(0), "gpu": torch.cuda.get_device_name(0),
            "gpu_total_bytes": torch.cuda.get_device_properties(0).total_memory, "layers": args.layers,
            "experts": args.experts or 384, "results": []}
    for stage, samples, cap in cases:
        row = run_case(src, out, stage, samples, cap, args.seq_len)
        head["results"].append(row)
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(head, indent=2) + "\n")
        plan = row["plan"]
        print(f"{stage:9s} {samples:4d} x {args.seq_len} cap={cap or 'free':6s} plan: states {plan['states_device']:6s}"
              f" chunk {plan['chunk_tokens']:6d} mat={plan['materialize']!s:5s} pre={plan['prefetch']!s:5s} "
              f"est {plan['estimated_peak_gpu_bytes'] / GIB:6.1f} GiB  measured reserved "
              f"{row['peak_reserved_bytes'] / GIB:6.1f} (alloc {row['peak_allocated_bytes'] / GIB:6.1f}) "
              f"= {row['measured_over_estimate']:.2f}x  {row['seconds']:6.1f} s  MoE layers "
              f"{[round(s, 1) for s in row['moe_layer_seconds']]}  OOM={row['out_of_memory']}", flush=True)


if __name__ == "__main__":
    main()
