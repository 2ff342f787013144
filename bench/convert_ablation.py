"""Which part of the pipeline limits a conversion: the same conversion with one cost removed at a time.

    python bench/convert_ablation.py --work /tmp/prof --device cuda --experts 64 --shards 8 --workers 8

All runs share one process, after a warm-up conversion (CUDA context, kernel loading), so each row is a
steady-state time. Rows: as shipped; without error stats; without sha256 (a no-op digest); without fsync;
output on tmpfs (/dev/shm); and all of those at once. The rows that remove a cost are diagnostics only:
the converter always hashes and fsyncs. Prints seconds and GB/s (INT4 and all tensors), and each run's
phase seconds (job threads, summed over jobs) plus per-job wall seconds.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import time
from pathlib import Path

GB = 1e9


class _NullDigest:
    def update(self, _data) -> None:
        pass

    def hexdigest(self) -> str:
        return "0" * 64


@contextlib.contextmanager
def _patched(no_hash: bool, no_fsync: bool):
    from kimi_nvfp4.checkpoint import writer

    saved_hash, saved_fsync = writer.hashlib.sha256, writer.os.fsync
    try:
        if no_hash:
            writer.hashlib = type("H", (), {"sha256": staticmethod(lambda: _NullDigest())})
        if no_fsync:
            writer.os = type("O", (), {**{k: getattr(os, k) for k in ("replace", "fspath")}, "fsync": staticmethod(lambda fd: None)})
        yield
    finally:
        writer.hashlib, writer.os = hashlib, os
        assert writer.hashlib.sha256 is saved_hash and writer.os.fsync is saved_fsync


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", default="/tmp/convert_ablation")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--method", default="amax")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--vocab-size", type=int, default=16384)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--tmpfs", default="/dev/shm")
    args = ap.parse_args()
    from kimi_nvfp4.convert import convert_checkpoint
    from kimi_nvfp4.convert.plan import plan_conversion
    from kimi_nvfp4.synth import create_synthetic_checkpoint, make_tiny_k2

    work = Path(args.work)
    source = work / f"src_L{args.layers}_E{args.experts}_S{args.shards}"
    if not (source / "config.json").is_file():
        create_synthetic_checkpoint(
            source, preset="k2.6", layers=args.layers, experts=args.experts, shards=args.shards, vocab_size=args.vocab_size
        )
    plan = plan_conversion(source)
    int4 = sum(j.int4_input_bytes for j in plan.jobs)
    total = sum(j.input_bytes for j in plan.jobs)
    print(f"checkpoint: {int4 / GB:.3f} GB INT4 of {total / GB:.3f} GB, {len(plan.jobs)} shards", flush=True)
    tiny = make_tiny_k2(work / "warmup_src", vocab_size=256, shards=2) if not (work / "warmup_src").exists() else work / "warmup_src"
    convert_checkpoint(tiny, work / "warmup_out", method=args.method, device=args.device, overwrite=True, progress=False)
    rows = [
        ("as shipped", {}),
        ("no stats", {"stats": False}),
        ("no sha256", {"no_hash": True}),
        ("no fsync", {"no_fsync": True}),
        ("tmpfs output", {"tmpfs": True}),
        ("no stats, sha256, fsync; tmpfs", {"stats": False, "no_hash": True, "no_fsync": True, "tmpfs": True}),
    ]
    for name, opt in rows:
        root = Path(args.tmpfs) if opt.get("tmpfs") else work
        output = root / "ablation_out"
        shutil.rmtree(output, ignore_errors=True)
        with _patched(opt.get("no_hash", False), opt.get("no_fsync", False)):
            start = time.perf_counter()
            summary = convert_checkpoint(
                source, output, method=args.method, device=args.device, workers=args.workers, overwrite=True,
                progress=False, record_stats=opt.get("stats", True),
            )
            seconds = time.perf_counter() - start
        shutil.rmtree(output, ignore_errors=True)
        phases = {k: round(v, 2) for k, v in summary.phase_seconds.items()}
        print(f"{name:34s} {seconds:6.2f} s  {int4 / GB / seconds:6.3f} GB/s INT4  {total / GB / seconds:6.3f} GB/s all  "
              f"phases {json.dumps(phases)}", flush=True)


if __name__ == "__main__":
    main()
