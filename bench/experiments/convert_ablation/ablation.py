"""Which part of the pipeline limits a conversion: the same conversion with one cost removed at a time.

    python -m bench.experiments.convert_ablation.ablation --work /tmp/prof --device cuda --experts 64 --shards 8 \
        --workers 8 --json bench/results/convert_ablation_h200.json

All runs share one process, after a warm-up conversion (CUDA context, kernel loading), so each row is a
steady-state time. Rows: as shipped (durable: every shard fsynced); `--no-fsync` (a user option: write-back
left to the OS); `--no-fsync --no-stats`; and, as diagnostics only, without sha256 (a no-op digest), output
on tmpfs (/dev/shm), and all of those at once (the converter always hashes). Prints seconds and GB/s (INT4
and all tensors), and each run's phase seconds (job threads, summed over jobs).

`--synth-device cuda` synthesises the source on the GPU (seconds instead of minutes for K2.6's 384 experts).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import time
from pathlib import Path

from bench.harness.results import bench_parser, write_result

GB = 1e9


class _NullDigest:
    def update(self, _data) -> None:
        pass

    def hexdigest(self) -> str:
        return "0" * 64


@contextlib.contextmanager
def _patched(no_hash: bool):
    from kimi_nvfp4.checkpoint import writer

    saved_hash = writer.hashlib.sha256
    try:
        if no_hash:
            writer.hashlib = type("H", (), {"sha256": staticmethod(lambda: _NullDigest())})
        yield
    finally:
        writer.hashlib = hashlib
        assert writer.hashlib.sha256 is saved_hash


def main() -> None:
    ap = bench_parser(__doc__)
    ap.add_argument("--work", default="/tmp/convert_ablation")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--method", dest="methods", action="append", help="Repeatable (default: int4-aware).")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--vocab-size", type=int, default=16384)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--tmpfs", default="/dev/shm")
    ap.add_argument("--synth-device", default="cpu", help="Where the synthetic source is generated.")
    ap.add_argument("--rows", default="all", help="Comma-separated row numbers (1-based) to run, or 'all'.")
    ap.add_argument("--warmup-full", action="store_true",
                    help="Convert the whole source once (unmeasured, --no-fsync) first: the first full-size run also grows "
                         "the CUDA caching allocator and loads kernels (measured ~2.9 s extra on the H200), a one-time "
                         "cost a 595 GB conversion amortises.")
    ap.add_argument("--workers-list", default=None, help="Comma-separated --workers values to compare (default: --workers).")
    ap.add_argument("--switch-interval", type=float, nargs="*", default=None,
                    help="sys.setswitchinterval values (seconds) to compare; default: Python's.")
    ap.add_argument("--input-ring", choices=["on", "off", "both"], default="on",
                    help="CUDA inputs through the job's reused page-locked buffers (on, as shipped) or pageable copies.")
    args = ap.parse_args()
    methods = args.methods or ["int4-aware"]
    from kimi_nvfp4.convert import convert_checkpoint
    from kimi_nvfp4.convert.plan import plan_conversion
    from kimi_nvfp4.synth import create_synthetic_checkpoint, make_tiny_k2

    work = Path(args.work)
    source = work / f"src_L{args.layers}_E{args.experts}_S{args.shards}"
    if not (source / "config.json").is_file():
        create_synthetic_checkpoint(
            source, preset="k2.6", layers=args.layers, experts=args.experts, shards=args.shards,
            vocab_size=args.vocab_size, device=args.synth_device, progress=True,
        )
    plan = plan_conversion(source)
    int4 = sum(j.int4_input_bytes for j in plan.jobs)
    total = sum(j.input_bytes for j in plan.jobs)
    print(f"checkpoint: {int4 / GB:.3f} GB INT4 of {total / GB:.3f} GB, {len(plan.jobs)} shards", flush=True)
    tiny = make_tiny_k2(work / "warmup_src", vocab_size=256, shards=2) if not (work / "warmup_src").exists() else work / "warmup_src"
    for method in methods:
        convert_checkpoint(tiny, work / "warmup_out", method=method, device=args.device, overwrite=True, progress=False)
    rows = [
        ("as shipped (fsync)", {}),
        ("--no-fsync", {"fsync": False}),
        ("--no-fsync --no-stats", {"fsync": False, "stats": False}),
        ("no sha256 (diagnostic)", {"no_hash": True}),
        ("tmpfs output (diagnostic)", {"tmpfs": True}),
        ("no stats/sha256/fsync; tmpfs", {"stats": False, "no_hash": True, "fsync": False, "tmpfs": True}),
    ]
    chosen = range(1, len(rows) + 1) if args.rows == "all" else [int(r) for r in args.rows.split(",")]
    from kimi_nvfp4.convert import job

    import sys

    if args.warmup_full:
        shutil.rmtree(work / "warmup_full", ignore_errors=True)
        convert_checkpoint(source, work / "warmup_full", method=methods[0], device=args.device, workers=args.workers,
                           progress=False, fsync=False)
        shutil.rmtree(work / "warmup_full", ignore_errors=True)
    rings = {"on": [True], "off": [False], "both": [True, False]}[args.input_ring]
    workers_list = [int(w) for w in args.workers_list.split(",")] if args.workers_list else [args.workers]
    intervals = args.switch_interval or [sys.getswitchinterval()]
    default_interval = sys.getswitchinterval()
    grid = [(m, r, n, w, i) for m in methods for r in rings for n in chosen for w in workers_list for i in intervals]
    results = []
    for method, ring, number, workers, interval in grid:
        job._PINNED_INPUT_RING["cuda"] = ring
        sys.setswitchinterval(interval)
        name, opt = rows[number - 1]
        name = name if ring else f"{name}, pageable inputs"
        if len(workers_list) > 1 or len(intervals) > 1:
            name = f"{name}, {workers} workers" + ("" if interval == default_interval else f", switch {interval * 1e3:g} ms")
        root = Path(args.tmpfs) if opt.get("tmpfs") else work
        output = root / "ablation_out"
        shutil.rmtree(output, ignore_errors=True)
        os.sync()  # each row starts with no dirty pages left over from the previous one
        with _patched(opt.get("no_hash", False)):
            start = time.perf_counter()
            summary = convert_checkpoint(
                source, output, method=method, device=args.device, workers=workers, overwrite=True,
                progress=False, record_stats=opt.get("stats", True), fsync=opt.get("fsync", True),
            )
            seconds = time.perf_counter() - start
        shutil.rmtree(output, ignore_errors=True)
        phases = {k: round(v, 2) for k, v in summary.phase_seconds.items()}
        print(f"{method:10s} {name:30s} {seconds:6.2f} s  {int4 / GB / seconds:6.3f} GB/s INT4  "
              f"{total / GB / seconds:6.3f} GB/s all  phases {json.dumps(phases)}", flush=True)
        results.append({"method": method, "row": name, "workers": workers, "switch_interval_s": interval,
                        "pinned_input_ring": ring, "seconds": seconds, "gb_per_s_int4": int4 / GB / seconds,
                        "gb_per_s_all": total / GB / seconds, "phase_seconds": phases})
    write_result(args.json, {"layers": args.layers, "experts": args.experts, "shards": args.shards,
                             "int4_bytes": int4, "total_bytes": total, "rows": results}, device=args.device)


if __name__ == "__main__":
    main()
