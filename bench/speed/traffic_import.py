"""Reading served traffic: records/s and peak RSS of the `sglang-dump:` importer on synthetic SGLang dumps.

Writes `--requests` synthetic requests (agent sessions: each turn's prompt extends the last; `--prompt-tokens`
mean, `--output-tokens` each) as SGLang request dumps of `--per-file` requests (tokenizer_manager.py's
`dump_requests_threshold`, 1000 by default), then reads the folder with the restricted unpickler, file by file,
the way `load_data_spec("sglang-dump:DIR")` does, and reports records/s and the peak RSS of reading alone
(`--stream`: requests are counted and dropped, the memory of the reader) and of loading them all (the memory
calibrate's windowing starts from). `--window` also measures the whole path calibrate takes (read + group into
conversations + window + pick `--samples` windows of `--seq-len`): the bounded streaming windower
(data/stream_windows.py) and, with `--window-in-memory`, the exact in-memory one (data/windows.py). Each mode runs
in its own child process, so each peak RSS is its own.

    python -m bench.speed.traffic_import --requests 100000 --json bench/results/traffic_import_cpu.json
    python -m bench.speed.traffic_import --requests 20000 --window --window-in-memory \
        --json bench/results/traffic_window_20k_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.harness.fixtures import test_fixture
from bench.harness.provenance import REPO_ROOT as ROOT
from bench.harness.provenance import provenance


def _peak_rss_mib() -> float:
    """This process's peak RSS: /proc's VmHWM, which starts afresh at exec (getrusage's ru_maxrss keeps the
    parent's peak across fork + exec, and hid the child's own peak below the folder writer's)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024.0
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _current_rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024.0
    return float("nan")


def write_folder(folder: Path, requests: int, per_file: int, prompt_tokens: int, output_tokens: int) -> int:
    import pickle
    import random

    fixtures = test_fixture("tests/data/traffic_fixtures.py")  # the SGLang stand-ins (upstream field names)
    ServerArgs, entry, sglang_names = fixtures.ServerArgs, fixtures.entry, fixtures.sglang_names

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


def window_folder(folder: Path, mode: str, samples: int, seq_len: int) -> dict:
    """Read + group + window + pick, streaming (bounded) or in memory (exact prefix tree)."""
    from kimi_nvfp4.data.tokenizer import load_tokenizer
    from kimi_nvfp4.demo_model import DEMO_CHECKPOINT

    tokenizer = load_tokenizer(DEMO_CHECKPOINT)  # prompts are ids: only its special ids (group keys) are used
    spec = f"sglang-dump:{folder}"
    from kimi_nvfp4.data.loaders import load_data_spec
    from kimi_nvfp4.data.source_registry import LoadResult
    from kimi_nvfp4.data.stats import pick
    from kimi_nvfp4.data.stream_windows import StreamWindower, stream_dump_requests, stream_sample_windows
    from kimi_nvfp4.data.windows import split_windows

    rss_before = _current_rss_mib()  # after the imports: what follows is the data's own memory
    t0 = time.perf_counter()
    if mode == "stream":
        result = LoadResult(source=spec)
        windower = StreamWindower(tokenizer, seq_len, samples, 0, heldout_fraction=0.2)
        streamed = stream_sample_windows(stream_dump_requests(spec, result), windower)
        parts = {"calibration": streamed.calibration, "heldout": streamed.heldout}
        out = {"requests": sum(p.requests for p in parts.values()),
               "full_windows": {k: p.full for k, p in parts.items()},
               "picked": {k: len(streamed.sequences(k, samples)) for k in parts},
               "conversations": {k: len(p.conversations) for k, p in parts.items()},
               "unique_token_fraction": round(streamed.unique_token_fraction, 4),
               "prefix_cache_entries": streamed.cache_entries}
    else:
        results = load_data_spec(spec)
        windows = split_windows(results, tokenizer, seq_len, heldout_fraction=0.2)
        parts = {"calibration": windows.calibration, "heldout": windows.heldout}
        full = {k: sum(1 for s in p.sequences if s.numel() == seq_len) for k, p in parts.items()}
        out = {"requests": sum(len(r.requests) for r in results), "full_windows": full,
               "picked": {k: len(pick(p.sequences, min(samples, full[k]), 0, seq_len=seq_len, data=spec, part=k))
                          for k, p in parts.items()},
               "conversations": {"calibration": windows.calibration_groups, "heldout": windows.heldout_groups},
               "unique_token_fraction": round(windows.unique_token_fraction, 4)}
    seconds = time.perf_counter() - t0
    return {**out, "seconds": round(seconds, 3), "requests_per_s": round(out["requests"] / seconds, 1),
            "rss_before_reading_mib": round(rss_before, 1), "peak_rss_mib": round(_peak_rss_mib(), 1),
            "peak_rss_over_imports_mib": round(_peak_rss_mib() - rss_before, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=100_000)
    ap.add_argument("--per-file", type=int, default=1000)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--output-tokens", type=int, default=16)
    ap.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "traffic_import_cpu.json")
    ap.add_argument("--window", action="store_true", help="also measure read + group + window (streaming)")
    ap.add_argument("--window-in-memory", action="store_true", help="and the exact in-memory windowing")
    ap.add_argument("--samples", type=int, default=512, help="windows picked per part (--window)")
    ap.add_argument("--seq-len", type=int, default=256, help="window length (--window)")
    ap.add_argument("--_read", choices=["stream", "all", "window-stream", "window-memory"], help=argparse.SUPPRESS)
    ap.add_argument("--_folder", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._read:  # a child process, so each mode's peak RSS is its own
        if args._read.startswith("window-"):
            print(json.dumps(window_folder(args._folder, args._read.split("-")[1], args.samples, args.seq_len)))
        else:
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
        wanted = ["stream", "all"] + (["window-stream"] if args.window else []) + (
            ["window-memory"] if args.window_in_memory else [])
        for mode in wanted:
            out = subprocess.run([sys.executable, "-m", "bench.speed.traffic_import", "--_read", mode, "--_folder", str(folder),
                                  "--samples", str(args.samples), "--seq-len", str(args.seq_len)],
                                 cwd=ROOT, check=True, capture_output=True, text=True).stdout
            modes[mode] = json.loads(out.strip().splitlines()[-1])
    result = {
        **provenance(device="cpu"),
        "settings": {"requests": args.requests, "per_file": args.per_file, "prompt_tokens": args.prompt_tokens,
                     "output_tokens": args.output_tokens},
        "folder": {"files": files, "mib": round(folder_mib, 1), "write_s": round(write_s, 1)},
        "read_streaming": modes["stream"], "read_all": modes["all"],
    }
    if args.window:
        result["settings"].update(samples=args.samples, seq_len=args.seq_len)
        result["window_streaming"] = modes["window-stream"]
    if args.window_in_memory:
        result["window_in_memory"] = modes["window-memory"]
    args.json.parent.mkdir(parents=True, exist_ok=True)
    partial = args.json.with_name(f".{args.json.name}.partial")
    partial.write_text(json.dumps(result, indent=2) + "\n")
    os.replace(partial, args.json)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
