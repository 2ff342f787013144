"""Benchmark `kimi-nvfp4 convert` against llm-compressor's `model_free_ptq` on the same INT4 checkpoint.

Each conversion runs in its own child process so that its peak RSS (VmHWM) belongs to it alone; a
child that only imports torch and our package gives the baseline RSS to subtract.

    python -m bench.speed.convert --work /tmp/bench_convert --method amax --method int4-aware       # CPU
    python -m bench.speed.convert --work /tmp/bench_convert --device cuda --experts 64 --workers 4   # H200
    python -m bench.speed.convert ... --peer-python /tmp/venv-llmc/bin/python   # llm-compressor in another venv
    python -m bench.speed.convert --device cuda --experts 384 --layers 2 --synth-device cuda --workers 4   # real MoE layer

The checkpoint is `synth --preset k2.6` (real K2.6 tensor shapes) with few layers and experts.
Speed is GB/s of INT4 expert input (weight_packed + weight_scale bytes) over the wall time of the
conversion call (imports excluded), and GB/s of all source tensor bytes (pass-through included; real
K2.6 is ~95% INT4 experts, so use `--experts 128` or more for a representative mix). The peer runs `model_free_ptq(scheme="NVFP4A16")` with
compressed-tensors' `CompressedTensorsDequantizer` (INT4 -> BF16 -> NVFP4), leaving the same modules
in BF16. Results: `bench_convert_<device>.{json,md}` in `--work` (and printed).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

GB = 1e9
# Modules the peer must leave in BF16 so both tools produce the same precision split (SPEC §2).
PEER_IGNORE = [
    "re:.*lm_head$",
    "re:.*embed_tokens$",
    "re:.*self_attn.*",
    "re:.*shared_experts.*",
    "re:.*mlp\\.(gate|up|down)_proj$",
    "re:.*mlp\\.gate$",
    "re:^vision_tower.*",
    "re:^mm_projector.*",
]
TARGET_SPEEDUP = 3.0
TARGET_MEMORY_RATIO = 0.5
METHODS = ("amax", "int4-aware", "sweep")
H2D_BYTES = 1 << 30
H2D_REPEATS = 5


def _peak_rss_bytes() -> int:
    """This process's peak RSS. VmHWM belongs to the address space made at exec; ru_maxrss would also
    count the forking parent's RSS (Linux carries that high-water mark across fork and exec)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _h2d_rates() -> dict[str, float]:
    import torch

    rates = {}
    for pinned in (True, False):
        host = torch.empty(H2D_BYTES, dtype=torch.uint8, pin_memory=pinned)
        dev = torch.empty(H2D_BYTES, dtype=torch.uint8, device="cuda")
        dev.copy_(host)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(H2D_REPEATS):
            dev.copy_(host, non_blocking=pinned)
        torch.cuda.synchronize()
        rates["pinned" if pinned else "pageable"] = H2D_REPEATS * H2D_BYTES / GB / (time.perf_counter() - start)
    return rates


def child_main(args: argparse.Namespace) -> None:
    """Run one measured task and print one JSON line."""
    result: dict = {"task": args.child}
    if args.child == "baseline":
        import torch  # noqa: F401

        import kimi_nvfp4.convert  # noqa: F401
    elif args.child == "ours":
        from kimi_nvfp4.convert import convert_checkpoint

        if args.device == "cuda":
            # One-time costs (CUDA context, lazy kernel loading: ~1 s) would dominate a few-GB benchmark of a
            # 595 GB job: convert a tiny checkpoint first so the timed run is steady state.
            import tempfile

            from kimi_nvfp4.synth import make_tiny_k2

            with tempfile.TemporaryDirectory() as tmp:
                tiny = make_tiny_k2(Path(tmp) / "src", vocab_size=256, shards=2)
                convert_checkpoint(tiny, Path(tmp) / "out", method=args.method, device="cuda", progress=False,
                                   record_stats=not args.no_stats)
        start = time.perf_counter()
        summary = convert_checkpoint(
            args.source, args.output, method=args.method, device=args.device, workers=args.workers,
            overwrite=True, progress=False, record_stats=not args.no_stats, fsync=not args.no_fsync,
        )
        result.update(seconds=time.perf_counter() - start, summary=summary.to_dict())
    elif args.child == "peer":
        try:
            from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import (
                CompressedTensorsDequantizer,
            )
            from llmcompressor import model_free_ptq
        except ImportError as e:
            result.update(error=f"llm-compressor is not importable ({e}); pip install llmcompressor or pass --peer-python")
            print(json.dumps(result))
            return
        device = "cuda:0" if args.device == "cuda" else "cpu"
        start = time.perf_counter()
        model_free_ptq(
            args.source, args.output, scheme="NVFP4A16", ignore=PEER_IGNORE, max_workers=args.workers, device=device,
            converter=CompressedTensorsDequantizer(args.source),
        )
        result.update(seconds=time.perf_counter() - start)
    elif args.child == "h2d":
        result.update(h2d_gb_per_s=_h2d_rates())
    result["peak_rss_bytes"] = _peak_rss_bytes()
    print(json.dumps(result))


def run_child(
    python: str, task: str, args: argparse.Namespace, source: Path, output: Path, method: str = "amax",
    stats: bool = True, fsync: bool = True,
) -> dict:
    os.sync()  # no dirty pages of an earlier run are written back during this one
    cmd = [
        python, str(Path(__file__).resolve()), "--child", task, "--source", str(source), "--output", str(output),
        "--device", args.device, "--workers", str(args.workers), "--method", method, *([] if stats else ["--no-stats"]),
        *([] if fsync else ["--no-fsync"]),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"{task} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1])


def ensure_source(args: argparse.Namespace) -> Path:
    from kimi_nvfp4.synth import create_synthetic_checkpoint
    from kimi_nvfp4.synth.writing import resolve_synth_device

    # A CUDA-generated source has other (equally distributed) contents than a CPU one: cache it apart.
    synth_device = resolve_synth_device(args.synth_device).type
    device_tag = "" if synth_device == "cpu" else f"_D{synth_device}"
    source = Path(args.work) / f"src_k26_L{args.layers}_E{args.experts}_V{args.vocab_size}_S{args.shards}{device_tag}"
    if not (source / "config.json").is_file():
        print(f"writing synthetic checkpoint {source} ...", flush=True)
        create_synthetic_checkpoint(
            source, preset="k2.6", layers=args.layers, experts=args.experts, shards=args.shards,
            vocab_size=args.vocab_size, device=synth_device, workers=args.synth_workers, progress=True,
        )
    return source


def markdown(report: dict) -> str:
    base = report["baseline_rss_bytes"]
    device = report["device"]

    def row(tool: str, r: dict) -> str:
        return (
            f"| {tool} | {device} | {r['seconds']:.2f} | {r['int4_gb_per_s']:.4f} | "
            f"{report['tensor_bytes'] / GB / r['seconds']:.4f} | {r['peak_rss_bytes'] / GB:.2f} | "
            f"{(r['peak_rss_bytes'] - base) / GB:.2f} |"
        )

    rows = [
        "| tool | device | seconds | INT4 GB/s | all tensors GB/s | peak RSS GB | peak RSS − import baseline GB |",
        "|---|---|---|---|---|---|---|",
    ]
    for method, ours in report["ours"].items():
        rows.append(row(f"kimi-nvfp4 convert --method {method} --workers {report['workers']}", ours))
    peer = report.get("peer")
    if peer and "seconds" in peer:
        rows.append(row(f"llm-compressor model_free_ptq NVFP4A16, max_workers {report['workers']}", peer))
    lines = [
        (
            f"Checkpoint: synth k2.6, {report['layers']} layers ({report['layers'] - 1} MoE) x {report['experts']} experts, "
            f"vocab {report['vocab_size']}, {report['shards']} shards; INT4 expert input {report['int4_bytes'] / GB:.3f} GB, "
            f"all tensors {report['tensor_bytes'] / GB:.3f} GB, largest shard {report['max_shard_bytes'] / GB:.3f} GB; "
            f"import baseline RSS {base / GB:.2f} GB."
        ),
        "",
        *rows,
        "",
    ]
    for method, r in report.get("ratios", {}).items():
        lines.append(
            f"- `{method}`: speed ours/peer **{r['speedup']:.2f}x** (target >= {TARGET_SPEEDUP}x); peak RSS ours/peer "
            f"**{r['memory_ratio']:.2f}**, net of the import baseline **{r['memory_ratio_net']:.2f}** "
            f"(target <= {TARGET_MEMORY_RATIO})."
        )
    if "h2d" in report:
        h = report["h2d"]
        lines.append(f"- Host-to-device copy: {h['pinned']:.1f} GB/s pinned, {h['pageable']:.1f} GB/s pageable.")
    for method, ours in report["ours"].items():
        lines.append(
            f"- `{method}`: most tensor bytes one job held {ours['peak_tensor_bytes'] / GB:.3f} GB "
            f"(largest shard {report['max_shard_bytes'] / GB:.3f} GB)."
        )
    return "\n".join(lines) + "\n"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", default="/tmp/bench_convert", help="Folder for the checkpoint, outputs and reports.")
    p.add_argument("--layers", type=int, default=3, help="Decoder layers (layer 0 dense, the rest MoE).")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--shards", type=int, default=4)
    p.add_argument("--vocab-size", type=int, default=16384,
                   help="Embedding rows; Kimi's 163840 adds 4.7 GB of BF16 pass-through to both tools.")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--workers", type=int, default=1, help="Our --workers and the peer's max_workers.")
    p.add_argument("--synth-device", choices=["cpu", "cuda", "auto"], default="cpu",
                   help="Where the source checkpoint is synthesised (cuda: seconds for 384 experts, other contents).")
    p.add_argument("--synth-workers", type=int, default=1, help="Processes synthesising the source checkpoint.")
    p.add_argument("--method", dest="methods", action="append", choices=METHODS,
                   help="Our scale method(s) to time; repeat for several (default: int4-aware).")
    p.add_argument("--peer-python", default=sys.executable, help="Python that has llmcompressor installed.")
    p.add_argument("--skip-peer", action="store_true")
    p.add_argument("--json", default=None, help="Also write the report here (bench/results/...).")
    p.add_argument("--also-no-stats", action="store_true",
                   help="Also time each method with --no-stats (no per-matrix error statistics; same bytes).")
    p.add_argument("--also-no-fsync", action="store_true",
                   help="Also time each method with --no-fsync (write-back left to the OS, as the peer does; same bytes).")
    p.add_argument("--no-stats", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--no-fsync", action="store_true", help=argparse.SUPPRESS)
    # child mode (internal)
    p.add_argument("--child", choices=["baseline", "ours", "peer", "h2d"], help=argparse.SUPPRESS)
    p.add_argument("--source", help=argparse.SUPPRESS)
    p.add_argument("--output", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.methods = args.methods or ["int4-aware"]
    args.method = args.methods[0]
    return args


def main() -> None:
    args = parse_args()
    if args.child:
        child_main(args)
        return

    from kimi_nvfp4.convert import plan_conversion

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    source = ensure_source(args)
    plan = plan_conversion(source)
    report: dict = {
        "device": args.device, "workers": args.workers, "layers": args.layers, "experts": args.experts,
        "shards": args.shards, "vocab_size": args.vocab_size, "int4_bytes": plan.int4_input_bytes,
        "tensor_bytes": plan.input_bytes, "max_shard_bytes": max(j.input_bytes for j in plan.jobs), "ours": {},
    }
    report["baseline_rss_bytes"] = run_child(sys.executable, "baseline", args, source, work / "none")["peak_rss_bytes"]
    variants = [(m, True, True) for m in args.methods]
    variants += [(m, True, False) for m in args.methods] if args.also_no_fsync else []
    variants += [(m, False, True) for m in args.methods] if args.also_no_stats else []
    for method, stats, fsync in variants:
        name = method + ("" if stats else " --no-stats") + ("" if fsync else " --no-fsync")
        print(f"running kimi-nvfp4 convert --method {name} ...", flush=True)
        ours = run_child(sys.executable, "ours", args, source, work / f"out_ours_{args.device}", method, stats, fsync)
        ours["int4_gb_per_s"] = plan.int4_input_bytes / GB / ours["seconds"]
        ours["peak_tensor_bytes"] = ours["summary"]["peak_tensor_bytes"]
        ours["total_gb_per_s"] = plan.input_bytes / GB / ours["seconds"]
        report["ours"][name] = ours
    if args.device == "cuda":
        report["h2d"] = run_child(sys.executable, "h2d", args, source, work / "none")["h2d_gb_per_s"]
    if not args.skip_peer:
        print("running llm-compressor model_free_ptq ...", flush=True)
        peer = run_child(args.peer_python, "peer", args, source, work / f"out_peer_{args.device}")
        if "error" in peer:
            print(peer["error"], file=sys.stderr)
        else:
            peer["int4_gb_per_s"] = plan.int4_input_bytes / GB / peer["seconds"]
            base = report["baseline_rss_bytes"]
            report["ratios"] = {
                method: {
                    "speedup": peer["seconds"] / ours["seconds"],
                    "memory_ratio": ours["peak_rss_bytes"] / peer["peak_rss_bytes"],
                    "memory_ratio_net": (ours["peak_rss_bytes"] - base) / max(1, peer["peak_rss_bytes"] - base),
                }
                for method, ours in report["ours"].items()
            }
        report["peer"] = peer
    from bench.harness.provenance import provenance

    report.update(provenance())
    stem = work / f"bench_convert_{args.device}"
    stem.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    if args.json:  # e.g. bench/results/...: the file docs/benchmarks.md's convert_vs_peer tables render from
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    text = markdown(report)
    stem.with_suffix(".md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
