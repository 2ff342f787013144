"""Benchmark validate on K2.6-shaped layers and project the whole-model time on 512 held-out sessions.

Builds (or reuses) a synthetic K2.6-shaped checkpoint (`--layers` layers: layer 0 dense, the rest
MoE), converts it, calibrates it quickly (a few sequences; the scales only need to exist), then
times the validate pieces separately: the structural scan, the per-layer side-by-side run (INT4
stream + one NVFP4 stream per mode, weight check and per-expert errors included), and the logits
comparison. Projection for K2.6 = 1 dense + 60 MoE layers at the measured per-layer times, plus
logits and the structure scan scaled by tensor bytes. Run on the H200:

    python -m bench.speed.validate --device cuda --work-dir /tmp/kimi_bench --json bench_validate.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from kimi_nvfp4.calibrate import ExpertPolicy
from kimi_nvfp4.calibrate.api import run_calibration
from kimi_nvfp4.stage_kit.device import resolve_device
from kimi_nvfp4.calibrate.shard import INPUT_SCALES_SHARD, install_input_scales
from kimi_nvfp4.checkpoint.reader import CheckpointReader
from kimi_nvfp4.model.linear import ActivationMode
from kimi_nvfp4.model.nvfp4_linears import InputScaleReduction
from kimi_nvfp4.validate import DEFAULT_GATES
from kimi_nvfp4.model import linear as linear_module
from kimi_nvfp4.validate.streams import compare_streams
from kimi_nvfp4.validate.experts import DEFAULT_EXPERT_CHECK_TOKENS
from kimi_nvfp4.validate.baseline import baseline_enabled
from kimi_nvfp4.validate.structure import check_structure
from kimi_nvfp4.stage_kit.layer_memory import peak_allocated, reset_peak

K26_LAYERS = 61
K26_DENSE_LAYERS = 1
K26_CHECKPOINT_BYTES = 595e9
CALIBRATION_SEQUENCES = 8


def main() -> None:

    from bench.harness.k26_checkpoint import H200_BF16_MEASURED_TFLOPS, moe_layer_flops_per_token, prepare, sequences
    from bench.harness.provenance import provenance

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--work-dir", type=Path, default=Path("/tmp/kimi_nvfp4_bench"))
    ap.add_argument("--preset", default="k2.6")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--experts", type=int, default=None, help="routed experts per MoE layer (default: the preset's)")
    ap.add_argument("--vocab-size", type=int, default=None, help="smaller vocab for a faster synthetic checkpoint")
    ap.add_argument("--samples", type=int, default=512)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--modes", default="w4a4,w4a16")
    ap.add_argument("--max-chunk-tokens", type=int, default=None)
    ap.add_argument("--states-device", default=None)
    ap.add_argument("--data", default=None)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--synth-device", default="cpu", help="where to synthesize the checkpoint (cuda: ~15 s at 384 experts)")
    ap.add_argument("--dtype", default="auto", help="compute dtype of the streams (auto: bf16 on CUDA)")
    ap.add_argument("--json", type=Path, default=Path("bench_validate.json"))
    ap.add_argument("--label", default=None, help="what this run measures (the row's name in docs/benchmarks.md)")
    ap.add_argument("--baseline", choices=("auto", "on", "off"), default="auto",
                    help="the amax baseline stream, as `kimi-nvfp4 validate --baseline` (auto: on from 16384 tokens)")
    ap.add_argument("--expert-check-tokens", type=int, default=DEFAULT_EXPERT_CHECK_TOKENS,
                    help="tokens per expert and layer in the per-expert check (0: all), as validate's option")
    ap.add_argument("--reference-activations", action="store_true",
                    help="W4A4 activations through the reference torch path instead of the fused Triton kernel")
    args = ap.parse_args()
    linear_module.USE_FUSED_ACTIVATIONS = not args.reference_activations

    dev = resolve_device(args.device)
    args.work_dir.mkdir(parents=True, exist_ok=True)
    src, out = prepare(
        args.work_dir, args.preset, args.layers, str(dev), args.experts, args.vocab_size, args.synth_device
    )
    reader = CheckpointReader(out)
    if INPUT_SCALES_SHARD not in set(reader.weight_map.values()):
        calib = sequences(reader, out, CALIBRATION_SEQUENCES, min(args.seq_len, 512), None, 0)
        run = run_calibration(reader, calib, policy=ExpertPolicy.PEER_MAX, min_expert_tokens=1, device=dev)
        install_input_scales(out, run.scales, stage_settings={"bench": True})
        reader = CheckpointReader(out)
    src_reader = CheckpointReader(src)
    cfg = reader.layout.text

    t = time.perf_counter()
    structure = check_structure(reader, src_reader)
    structure_seconds = time.perf_counter() - t
    checkpoint_bytes = sum(i.nbytes for i in reader.tensors.values())

    seqs = sequences(reader, out, args.samples, args.seq_len, args.data, args.seed)
    tokens = sum(int(s.numel()) for s in seqs)
    modes = [ActivationMode(m) for m in args.modes.split(",")]
    if dev.type == "cuda":
        reset_peak(dev)
    baseline = baseline_enabled(args.baseline, tokens)
    streams = 1 + len(modes) + int(baseline)
    t = time.perf_counter()
    result = compare_streams(
        src_reader,
        reader,
        seqs,
        modes=modes,
        reduction=InputScaleReduction.LAYER_MAX,
        device=dev,
        flag_rel_mse=DEFAULT_GATES.weight_rel_mse_max,
        max_chunk_tokens=args.max_chunk_tokens,
        states_device=args.states_device,
        dtype=args.dtype,
        baseline=baseline,
        expert_check_tokens=args.expert_check_tokens,
    )
    total = time.perf_counter() - t
    moe = [s for i, s in enumerate(result.layer_seconds) if cfg.is_moe_layer(i)]
    dense = [s for i, s in enumerate(result.layer_seconds) if not cfg.is_moe_layer(i)]
    per_moe = sum(moe) / len(moe) if moe else 0.0
    per_dense = sum(dense) / len(dense) if dense else 0.0
    projected = (
        K26_DENSE_LAYERS * per_dense
        + (K26_LAYERS - K26_DENSE_LAYERS) * per_moe
        + result.logits_seconds
        + structure_seconds * K26_CHECKPOINT_BYTES / checkpoint_bytes
    )
    report = {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "preset": args.preset,
        "layers": cfg.num_hidden_layers,
        "samples": len(seqs),
        "seq_len": args.seq_len,
        "tokens": tokens,
        "modes": [m.value for m in modes],
        "baseline_stream": baseline,
        "expert_check_tokens": args.expert_check_tokens,
        "fused_activations": not args.reference_activations,
        "max_chunk_tokens": args.max_chunk_tokens,
        "structure_seconds": structure_seconds,
        "structure_passed": structure.passed,
        "checkpoint_bytes": checkpoint_bytes,
        "layer_seconds": result.layer_seconds,
        "phase_seconds": result.phase_seconds,
        "dense_layer_seconds": per_dense,
        "moe_layer_seconds": per_moe,
        "logits_seconds": result.logits_seconds,
        "total_seconds": total,
        "projected_k26_61_layers_seconds": projected,
        "projected_k26_61_layers_minutes": projected / 60,
        # Layer and logits time are linear in tokens: scale to 512 held-out sessions x seq_len.
        "projected_k26_61_layers_512_sessions_minutes": (projected - structure_seconds * K26_CHECKPOINT_BYTES / checkpoint_bytes)
        / 60 * 512 / len(seqs) + structure_seconds * K26_CHECKPOINT_BYTES / checkpoint_bytes / 60,
        "end_to_end": [e.model_dump(exclude={"kl_histogram_edges", "kl_histogram_counts"}) for e in result.end_to_end],
        "peak_gpu_memory_gib": peak_allocated(dev) / 2**30 if dev.type == "cuda" else None,
        # model FLOPs of the streams (INT4, one per mode, the baseline if on; the per-expert check not counted)
        "moe_layer_model_tflops_per_s": (
            tokens * moe_layer_flops_per_token(cfg, args.seq_len) * streams / per_moe / 1e12
            if per_moe else None
        ),
        "fraction_of_bf16_peak": (
            tokens * moe_layer_flops_per_token(cfg, args.seq_len) * streams / per_moe / 1e12
            / H200_BF16_MEASURED_TFLOPS if per_moe and dev.type == "cuda" else None
        ),
        "goal_minutes": 30,
        "projection_from": f"{cfg.num_hidden_layers} synthetic layers x {len(seqs)} sequences x {args.seq_len} tokens",
        "bf16_peak_tflops": H200_BF16_MEASURED_TFLOPS if dev.type == "cuda" else None,
        "label": args.label,
        **provenance(),
    }
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "layer_seconds"}, indent=2))


if __name__ == "__main__":
    main()
