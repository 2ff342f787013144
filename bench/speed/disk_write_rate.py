"""Durable write rate of a folder's disk with 1..N parallel writers (the ceiling of any converter that fsyncs).

    python -m bench.speed.disk_write_rate /tmp --gib 4 --writers 1 4 8 --json bench/results/disk_write_rate.json

Each writer writes its share of `--gib` in 64 MiB chunks of incompressible bytes to its own file, then fsyncs;
the rate is total bytes over the wall time until the last fsync returns. Files are removed afterwards.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from bench.harness.results import bench_parser, write_result

CHUNK = 64 << 20


def _write(path: Path, chunks: int, data: bytes) -> None:
    with path.open("wb") as f:
        for _ in range(chunks):
            f.write(data)
        f.flush()
        os.fsync(f.fileno())


def write_rate(folder: Path, nbytes: int, writers: int, data: bytes | None = None) -> dict:
    """Write `nbytes` (rounded down to whole 64 MiB chunks per writer, at least one) into `folder` with `writers`
    threads, each to its own file, fsync each, remove them; the row: writers, bytes, seconds, gb_per_s."""
    data = os.urandom(CHUNK) if data is None else data
    per_writer = max(1, nbytes // CHUNK // writers)
    paths = [Path(folder) / f".disk_write_rate.{i}" for i in range(writers)]
    threads = [threading.Thread(target=_write, args=(p, per_writer, data)) for p in paths]
    start = time.perf_counter()
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        seconds = time.perf_counter() - start
        for p in paths:
            p.unlink(missing_ok=True)
    written = per_writer * writers * CHUNK
    return {"writers": writers, "bytes": written, "seconds": seconds, "gb_per_s": written / 1e9 / seconds}


def main() -> None:
    ap = bench_parser(__doc__)
    ap.add_argument("folder", type=Path)
    ap.add_argument("--gib", type=int, default=4)
    ap.add_argument("--writers", type=int, nargs="+", default=[1, 4, 8])
    args = ap.parse_args()
    data = os.urandom(CHUNK)
    rows = []
    for writers in args.writers:
        row = write_rate(args.folder, args.gib * (1 << 30), writers, data)
        print(f"{writers} writers: {row['bytes'] / 1e9:.2f} GB in {row['seconds']:.2f} s = {row['gb_per_s']:.2f} GB/s "
              "(fsync)")
        rows.append(row)
    write_result(args.json, {"folder": str(args.folder), "gib": args.gib, "fsync": True, "rows": rows}, device="cpu")

if __name__ == "__main__":
    main()
