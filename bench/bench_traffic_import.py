"""Reading served traffic: records/s and peak RSS of the `sglang-dump:` importer on synthetic SGLang dumps.

Writes `--requests` synthetic requests (agent sessions: each turn's prompt extends the last; `--prompt-tokens`
mean, `--output-tokens` each) as SGLang request dumps of `--per-file` requests (tokenizer_manager.py's
`dump_requests_threshold`, 1000 by default), then reads the folder with the restricted unpickler, file by file,
the way `load_data_spec("sglang-dump:DIR")` does, and reports records/s and the peak RSS of reading alone
(`--stream`: requests are counted and dropped, the memory of the reader) and of loading them all (the memory
calibrate's windowing starts from).

    python bench/bench_traffic_import.py --requests 100000 --json bench/results/traffic_import_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "data"))  # the fixtures' SGLang stand-ins (upstream field names)
sys.path.insert(0, str(ROOT))


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _current_rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024.0
    return float("nan")


def write_folder(folder: Path, requests: int, per_file: int, prompt_tokens: int, output_tokens: int) -> int:
    import pickle
    import random

    from traffic_fixtures import ServerArgs, entry, sglang_names

    rng = random.Random(0)
    turns, written, n = 8, 0, 0
    with sglang_names():
        batch = []
        while n < requests:
            prompt = [163594] + [rng.randrange(163584) for _ in range(prompt_tokens // 2)]
            for k in range(turns):
                if n >= requests:
                    break
                output = [rng.randrange(163584) for _ in range(output_tokens)]
                batch.append(entry(list(prompt), output, t=float(n)))
                prompt = prompt + output + [rng.randrange(163584) for _ in range(prompt_tokens // turns)]
                n += 1
                if len(batch) == per_file:
                    data = {"server_args": ServerArgs(), "config_updates": [], "resolved_config": None,
                            "requests": batch}
                    path = folder / f"2026-01-01_00-{written // 60:02d}-{written % 60:02d}.pkl"
                    path.write_bytes(pickle.dumps(data, protocol=pickle.HIGHEST_PROTOCOL))
                    written += 1
                    batch = []
        if batch:
            (folder / "2026-01-01_99-99-99.pkl").write_bytes(pickle.dumps({"requests": batch}))
            written += 1
    return written


def read_folder(folder: Path, stream: bool) -> dict:
    from kimi_nvfp4.data.source_registry import LoadResult
    from kimi_nvfp4.data.sources.sglang_dump import _add, iter_dump

    rss_before = _current_rss_mib()  # the interpreter, torch and the importer modules, before any record
    t0 = time.perf_counter()
    result = LoadResult(source=str(folder))
    count = tokens = 0
    for where, entry in iter_dump(folder, result):
        _add(result, where, entry)
        if stream:  # count and drop: the reader's own memory
            request = result.requests.pop()
            count += 1
            tokens += len(request.prompt_ids) + len(request.output_ids or ())
    seconds = time.perf_counter() - t0
    if not stream:
        count = len(result.requests)
        tokens = sum(len(r.prompt_ids) + len(r.output_ids or ()) for r in result.requests)
    return {"requests": count, "skipped": result.skipped, "files": result.files, "tokens": tokens,
            "seconds": round(seconds, 3), "requests_per_s": round(count / seconds, 1),
            "rss_before_reading_mib": round(rss_before, 1), "peak_rss_mib": round(_peak_rss_mib(), 1),
            "peak_rss_over_imports_mib": round(_peak_rss_mib() - rss_before, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=100_000)
    ap.add_argument("--per-file", type=int, default=1000)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--output-tokens", type=int, default=16)
    ap.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "traffic_import_cpu.json")
    ap.add_argument("--_read", choices=["stream", "all"], help=argparse.SUPPRESS)
    ap.add_argument("--_folder", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._read:  # a child process, so each mode's peak RSS is its own
        print(json.dumps(read_folder(args._folder, args._read == "stream")))
        return
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "dumps"
        folder.mkdir()
        t0 = time.perf_counter()
        files = write_folder(folder, args.requests, args.per_file, args.prompt_tokens, args.output_tokens)
        write_s = time.perf_counter() - t0
        folder_mib = sum(p.stat().st_size for p in folder.iterdir()) / 2**20
        modes = {}
        for mode in ("stream", "all"):
            out = subprocess.run([sys.executable, __file__, "--_read", mode, "--_folder", str(folder)],
                                 check=True, capture_output=True, text=True).stdout
            modes[mode] = json.loads(out.strip().splitlines()[-1])
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    result = {
        "command": "python bench/bench_traffic_import.py " + " ".join(sys.argv[1:]),
        "commit": commit, "host": platform.node(), "device": f"cpu ({os.cpu_count()} cores)",
        "python": platform.python_version(),
        "settings": {"requests": args.requests, "per_file": args.per_file, "prompt_tokens": args.prompt_tokens,
                     "output_tokens": args.output_tokens},
        "folder": {"files": files, "mib": round(folder_mib, 1), "write_s": round(write_s, 1)},
        "read_streaming": modes["stream"], "read_all": modes["all"],
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    partial = args.json.with_name(f".{args.json.name}.partial")
    partial.write_text(json.dumps(result, indent=2) + "\n")
    os.replace(partial, args.json)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
