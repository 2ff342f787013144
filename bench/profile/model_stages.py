"""Where calibrate's and validate's time goes on a K2.6-shaped layer (torch.profiler + cProfile).

Builds (or reuses) the synthetic K2.6-dimension checkpoint of bench.speed.calibrate (`--layers`, 384 experts
by default), then runs the calibrate layer loop and validate's side-by-side stream comparison once each
under torch.profiler (kernel time per op) and cProfile (Python time per function), and writes the top
entries as JSON. Run on the H200:

    python -m bench.profile.model_stages --device cuda --work-dir /tmp/kimi_bench --samples 32 --json prof.json
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from kimi_nvfp4.calibrate import ExpertPolicy
from kimi_nvfp4.calibrate.api import run_calibration
from kimi_nvfp4.stage_kit.device import resolve_device
from kimi_nvfp4.calibrate.shard import INPUT_SCALES_SHARD, install_input_scales
from kimi_nvfp4.checkpoint.reader import CheckpointReader
from kimi_nvfp4.model.linear import ActivationMode
from kimi_nvfp4.model.nvfp4_linears import InputScaleReduction
from kimi_nvfp4.validate import DEFAULT_GATES
from kimi_nvfp4.validate.streams import compare_streams

TOP = 30


def _ops(prof, key: str) -> list[dict]:
    rows = []
    for e in sorted(prof.key_averages(), key=lambda e: -getattr(e, key))[:TOP]:
        rows.append(
            {
                "op": e.key,
                "calls": e.count,
                "self_device_ms": e.self_device_time_total / 1e3,
                "self_cpu_ms": e.self_cpu_time_total / 1e3,
            }
        )
    return rows


def _python(pr: cProfile.Profile) -> str:
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(TOP)
    return s.getvalue()


def _profiled(fn):
    pr = cProfile.Profile()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        t = time.perf_counter()
        pr.enable()
        out = fn()
        pr.disable()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        wall = time.perf_counter() - t
    return out, wall, prof, pr


def _stage_entry(wall: float, prof, pr: cProfile.Profile, **timings) -> dict:
    """One stage's part of the result file (printed as well): wall time, its own timings, the top ops and the
    Python profile."""
    entry = {"wall_s": wall, **timings, "by_device_time": _ops(prof, "self_device_time_total"),
             "by_cpu_time": _ops(prof, "self_cpu_time_total"), "python": _python(pr)}
    print(json.dumps({k: v for k, v in entry.items() if k != "python"}, indent=1)[:6000])
    print(entry["python"][:4000])
    return entry


def main() -> None:
    from bench.harness.k26_checkpoint import prepare, sequences
    from bench.harness.provenance import provenance

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--work-dir", type=Path, default=Path("/tmp/kimi_nvfp4_bench"))
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--experts", type=int, default=384)
    ap.add_argument("--vocab-size", type=int, default=16384)
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--synth-device", default="cuda")
    ap.add_argument("--skip", choices=["calibrate", "validate"], action="append", default=[])
    ap.add_argument("--json", type=Path, default=Path("profile_model_stages.json"))
    args = ap.parse_args()

    dev = resolve_device(args.device)
    args.work_dir.mkdir(parents=True, exist_ok=True)
    src, out = prepare(args.work_dir, "k2.6", args.layers, str(dev), args.experts, args.vocab_size, args.synth_device)
    reader = CheckpointReader(out)
    if INPUT_SCALES_SHARD not in set(reader.weight_map.values()):
        calib = sequences(reader, out, 4, 512, None, 0)
        run = run_calibration(reader, calib, policy=ExpertPolicy.PEER_MAX, min_expert_tokens=1, device=dev)
        install_input_scales(out, run.scales, stage_settings={"bench": True})
        reader = CheckpointReader(out)
    seqs = sequences(reader, out, args.samples, args.seq_len, None, 1)
    device_name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else str(dev)
    result: dict = {"device": device_name, "samples": args.samples, "seq_len": args.seq_len, "experts": args.experts,
                    **provenance()}

    if "calibrate" not in args.skip:
        run, wall, prof, pr = _profiled(
            lambda: run_calibration(
                reader, seqs, policy=ExpertPolicy.PEER_MAX, min_expert_tokens=32, device=dev, progress=False
            )
        )
        result["calibrate"] = _stage_entry(wall, prof, pr, layer_seconds=run.layer_seconds)
    if "validate" not in args.skip:
        src_reader = CheckpointReader(src)
        comp, wall, prof, pr = _profiled(
            lambda: compare_streams(
                src_reader, reader, seqs, modes=[ActivationMode.W4A4, ActivationMode.W4A16],
                reduction=InputScaleReduction.LAYER_MAX, device=dev, flag_rel_mse=DEFAULT_GATES.weight_rel_mse_max,
                progress=False,
            )
        )
        result["validate"] = _stage_entry(wall, prof, pr, layer_seconds=comp.layer_seconds,
                                          logits_seconds=comp.logits_seconds)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
