"""Where a conversion's time goes: component rates and a cProfile of one convert run.

    python -m bench.profile.convert --work /tmp/prof --device cuda --experts 32 --method amax \
        --json bench/results/profile_convert_h200.json

Prints (1) the rates of the pieces a shard job is made of, each measured alone on the same checkpoint:
reading INT4 tensors into page-locked memory, sha256, the numerics of one expert (gate+up, down) with a
device sync, and error stats; (2) the wall time of `convert_checkpoint` with `--workers 1` under cProfile,
with the top functions by own time (the writer thread is not profiled); (3) the same with `--workers N`.
"""

from __future__ import annotations

import cProfile
import hashlib
import io
import json
import pstats
import shutil
import time
from pathlib import Path

import torch

from bench.harness.results import bench_parser, write_result

GB = 1e9


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def component_rates(source: Path, device: torch.device, method: str, experts: int) -> dict[str, float]:
    from kimi_nvfp4.checkpoint.tensor_io import ShardFiles
    from kimi_nvfp4.convert.plan import plan_conversion
    from kimi_nvfp4.numerics.methods import Int4Matrix, quantize_int4_groups

    plan = plan_conversion(source)
    groups = [g for job in plan.jobs for g in job.groups][: 2 * experts]
    out: dict[str, float] = {}
    with ShardFiles(source) as files:
        start = time.perf_counter()
        host, nbytes = [], 0
        for g in groups:
            for m in g.matrices:
                p = files.read(m.packed.file, m.packed.name, pin_memory=device.type == "cuda")
                s = files.read(m.scale.file, m.scale.name, pin_memory=device.type == "cuda")
                host.append((m, p, s))
                nbytes += p.numel() * p.element_size() + s.numel() * s.element_size()
        out["read_int4_GBps"] = nbytes / GB / (time.perf_counter() - start)
    start = time.perf_counter()
    for _, p, _ in host:
        hashlib.sha256(memoryview(p.view(torch.uint8).numpy())).digest()
    out["sha256_GBps"] = sum(p.numel() * 4 for _, p, _ in host) / GB / (time.perf_counter() - start)
    start = time.perf_counter()
    dev = [(m, p.to(device, non_blocking=True), s.to(device, non_blocking=True)) for m, p, s in host]
    _sync(device)
    out["h2d_GBps"] = nbytes / GB / (time.perf_counter() - start)
    by_group: list[list[Int4Matrix]] = []
    i = 0
    for g in groups:
        mats = []
        for m in g.matrices:
            mats.append(Int4Matrix.from_packed(dev[i][1], dev[i][2], m.in_features))
            i += 1
        by_group.append(mats)
    for meth in ("amax", method):
        for stats in (False, True):
            quantize_int4_groups(by_group[:2], meth, record_stats=stats)  # warm-up
            _sync(device)
            start = time.perf_counter()
            quantize_int4_groups(by_group, meth, record_stats=stats)
            _sync(device)
            out[f"numerics_{meth}{'_stats' if stats else ''}_GBps"] = nbytes / GB / (time.perf_counter() - start)
    return out


def profiled_convert(source: Path, output: Path, device: str, method: str, workers: int, top: int) -> tuple[float, str]:
    from kimi_nvfp4.convert import convert_checkpoint

    prof = cProfile.Profile()
    start = time.perf_counter()
    if top:
        prof.enable()
    summary = convert_checkpoint(source, output, method=method, device=device, workers=workers, overwrite=True, progress=False)
    prof.disable()
    seconds = time.perf_counter() - start
    buf = io.StringIO()
    buf.write("phases (job-thread seconds, summed over jobs): ")
    buf.write(json.dumps({k: round(v, 2) for k, v in summary.phase_seconds.items()}) + "\n")
    if top:
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    return seconds, buf.getvalue()


def main() -> None:
    ap = bench_parser(__doc__)
    ap.add_argument("--work", default="/tmp/profile_convert")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--method", default="int4-aware")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--vocab-size", type=int, default=16384)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--out-root", default=None, help="where outputs go (default: --work); e.g. /dev/shm")
    ap.add_argument("--runs", default="1,N", help="worker counts to run, N = --workers (1 is profiled)")
    ap.add_argument("--no-components", action="store_true")
    ap.add_argument("--pinned", action="store_true", help="copy results back through fresh page-locked host memory (default: pageable)")
    args = ap.parse_args()
    from kimi_nvfp4.convert.plan import plan_conversion
    from kimi_nvfp4.synth import create_synthetic_checkpoint

    work = Path(args.work)
    source = work / f"src_L{args.layers}_E{args.experts}"
    if not (source / "config.json").is_file():
        start = time.perf_counter()
        create_synthetic_checkpoint(
            source, preset="k2.6", layers=args.layers, experts=args.experts, shards=args.shards, vocab_size=args.vocab_size
        )
        print(f"synth: {time.perf_counter() - start:.1f} s", flush=True)
    plan = plan_conversion(source)
    int4 = sum(j.int4_input_bytes for j in plan.jobs)
    total = sum(j.input_bytes for j in plan.jobs)
    print(f"checkpoint: {int4 / GB:.3f} GB INT4 of {total / GB:.3f} GB", flush=True)
    device = torch.device(args.device)
    rates, converts = None, []
    if not args.no_components:
        rates = component_rates(source, device, args.method, min(args.experts, 16))
        print(json.dumps({k: round(v, 3) for k, v in rates.items()}), flush=True)
    if args.pinned:
        from kimi_nvfp4.convert import job

        job._PINNED_STAGING["cuda"] = True
    runs = [args.workers if r == "N" else int(r) for r in args.runs.split(",")]
    for workers in runs:
        output = Path(args.out_root or work) / f"out_w{workers}"
        shutil.rmtree(output, ignore_errors=True)
        seconds, text = profiled_convert(source, output, args.device, args.method, workers, args.top)
        shutil.rmtree(output, ignore_errors=True)
        print(f"--- convert {args.method} workers={workers} -> {output}: {seconds:.2f} s, {int4 / GB / seconds:.3f} GB/s INT4, "
              f"{total / GB / seconds:.3f} GB/s all", flush=True)
        print(text, flush=True)
        converts.append({"workers": workers, "seconds": seconds, "gb_per_s_int4": int4 / GB / seconds,
                         "gb_per_s_all": total / GB / seconds, "profile_top": text})
    write_result(args.json, {"method": args.method, "layers": args.layers, "experts": args.experts,
                             "int4_bytes": int4, "total_bytes": total, "component_rates": rates,
                             "converts": converts}, device=args.device)


if __name__ == "__main__":
    main()
