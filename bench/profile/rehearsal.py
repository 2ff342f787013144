"""Full-depth rehearsal (issue 25): synth -> convert -> calibrate -> validate through the CLI on a K2.6-shaped
checkpoint of full depth (61 layers, full vocabulary, few experts), each stage a subprocess at the CLI's defaults.

    python -m bench.profile.rehearsal --source-dir /dev/shm/k26_src --work-dir /tmp/rehearsal --layers 61 \\
        --experts 8 --device cuda --synth-device cuda --json /root/out/rehearsal.json
    python -m bench.profile.rehearsal --preset tiny --layers 3 --experts 8 --source-dir /tmp/x --work-dir /tmp/y \\
        --device cpu --calibrate-args "--samples 2 --seq-len 64" --validate-args "--samples 2 --seq-len 64"

Per stage: wall time, exit code, the end of stderr on failure, the peaks polled every 0.5 s while it ran (GPU memory
used as nvidia-smi reports it, all processes of the GPU; the child's RSS with its children, psutil), and from the
stage's JSON report: per-layer seconds and peak GPU / host memory (stage_kit/layer_memory.py), the memory plan and
the totals. Also the disk's durable write rate where OUT goes (bench/speed/disk_write_rate.py), the sizes of SRC and
OUT and the free space before and after. The result file is rewritten after every stage (and on SIGTERM), so a run
cut short keeps what finished. SRC (`--source-dir`: on the GPU host /dev/shm, since its disk cannot hold both) is
synthesized once and reused; OUT is deleted afterwards unless `--keep`.

The whole-K2.6 figure printed at the end is a PROJECTION: the median measured MoE-layer seconds x 60 + the measured
dense layer, at the experts per layer of this run (K2.6 has 384), printed only when computed from measured layers.
"""

from __future__ import annotations

import json
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from bench.harness.results import bench_parser, write_result
from bench.speed.disk_write_rate import write_rate
from kimi_nvfp4.serve_check.launcher import terminate_process_group

K26_MOE_LAYERS = 60
SYNTH_DONE = "rehearsal_synth.json"  # beside SRC: the synth arguments of a finished checkpoint
POLL_SECONDS = 0.5
STDERR_TAIL_LINES = 40
STAGE_STOP_GRACE_S = 10.0  # a stage stopped at its timeout: SIGTERM, then SIGKILL after this


class Interrupted(Exception):
    """SIGTERM (e.g. the outer `timeout`): stop the running stage, write what finished."""


def _on_sigterm(signum, frame):
    raise Interrupted(f"signal {signum}")


def folder_bytes(folder: Path) -> int | None:
    if not folder.exists():
        return None
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file() and not p.is_symlink())


def free_bytes(folder: Path) -> int | None:
    for p in (folder, *folder.parents):
        if p.exists():
            return shutil.disk_usage(p).free
    return None


def gpu_used_bytes() -> list[int] | None:
    """Memory used on each GPU (every process), from nvidia-smi; None where it is absent or fails."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10, check=True).stdout
        return [int(float(line)) * 2**20 for line in out.split()]
    except (OSError, subprocess.SubprocessError, ValueError):
        return None


def tree_rss_bytes(pid: int) -> int | None:
    """RSS of the process and all its children (psutil); None without psutil or once it is gone."""
    try:
        import psutil

        proc = psutil.Process(pid)
        total = proc.memory_info().rss
        for child in proc.children(recursive=True):
            try:
                total += child.memory_info().rss
            except psutil.Error:
                pass
        return total
    except ImportError:
        return None
    except Exception:  # psutil.Error: the process ended between two polls
        return None


class Poller(threading.Thread):
    """Polls the child's tree RSS and the GPUs' used memory every `interval` seconds; keeps the maxima."""

    def __init__(self, pid: int, interval: float = POLL_SECONDS):
        super().__init__(daemon=True)
        self.pid, self.interval, self.stopped = pid, interval, threading.Event()
        self.rss_max: int | None = None
        self.gpu_max: int | None = None  # the most used on any one GPU
        self.gpu_seen = True

    def run(self) -> None:
        while not self.stopped.is_set():
            rss = tree_rss_bytes(self.pid)
            if rss is not None:
                self.rss_max = max(self.rss_max or 0, rss)
            if self.gpu_seen:
                used = gpu_used_bytes()
                self.gpu_seen = used is not None  # no nvidia-smi: stop asking
                if used:
                    self.gpu_max = max(self.gpu_max or 0, max(used))
            self.stopped.wait(self.interval)


def run_stage(name: str, argv: list[str], timeout: float, logs: Path) -> dict:
    """Run one CLI stage in its own process group with a timeout; wall time, exit code, polled peaks."""
    logs.mkdir(parents=True, exist_ok=True)
    out_log, err_log = logs / f"{name}.stdout", logs / f"{name}.stderr"
    gpu_before = gpu_used_bytes()
    entry = {"command": shlex.join(argv), "timeout_s": round(timeout, 1), "gpu_used_before_bytes":
             max(gpu_before) if gpu_before else None}
    print(f"=== {name} (timeout {timeout:.0f} s): {entry['command']}", flush=True)
    start = time.perf_counter()
    with out_log.open("wb") as out, err_log.open("wb") as err:
        proc = subprocess.Popen(argv, stdout=out, stderr=err, start_new_session=True)
        poller = Poller(proc.pid)
        poller.start()
        try:
            entry["exit_code"] = proc.wait(timeout=timeout)
            entry["timed_out"] = False
        except subprocess.TimeoutExpired:
            entry["exit_code"], entry["timed_out"] = None, True
        except Interrupted:
            entry["exit_code"], entry["timed_out"], entry["interrupted"] = None, False, True
        finally:
            if proc.poll() is None:
                _stop(proc)
            poller.stopped.set()
            poller.join()
    entry["wall_s"] = round(time.perf_counter() - start, 2)
    entry["child_peak_rss_bytes"] = poller.rss_max
    entry["gpu_used_peak_bytes"] = poller.gpu_max
    if entry["exit_code"] != 0:
        entry["stderr_tail"] = err_log.read_text(errors="replace").splitlines()[-STDERR_TAIL_LINES:]
    print(f"=== {name}: exit {entry['exit_code']}{' (timed out)' if entry['timed_out'] else ''} "
          f"in {entry['wall_s']} s", flush=True)
    if entry.get("interrupted"):
        raise Interrupted(name)
    return entry


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM the stage's process group (its own session), SIGKILL it after 10 s."""
    terminate_process_group(proc, STAGE_STOP_GRACE_S)


def stage_report(path: Path) -> dict | None:
    """What the rehearsal keeps of a calibrate / validate JSON report: per-layer costs, the memory plan, totals."""
    if not path.is_file():
        return None
    r = json.loads(path.read_text())
    memory = r.get("layer_memory") or {}
    gpu, host = memory.get("gpu_peak_bytes"), [b for b in memory.get("host_peak_rss_bytes") or [] if b]
    layer_seconds = r.get("layer_seconds") or []
    kept = {
        "report": str(path),
        "seconds": r.get("seconds"),
        "device": r.get("device"),
        "settings": {k: v for k, v in (r.get("settings") or {}).items() if k in ("data", "samples", "seq_len", "dtype",
                                                                                   "modes")},
        "tokens": r.get("tokens"),
        "layer_seconds": layer_seconds,
        "layer_gpu_peak_bytes": gpu,
        "layer_host_peak_rss_bytes": memory.get("host_peak_rss_bytes"),
        "memory_plan": r.get("memory_plan"),
        "totals": {"layers": len(layer_seconds), "layer_seconds_sum": round(sum(layer_seconds), 2),
                   "gpu_peak_bytes_max": max(gpu) if gpu else None, "host_peak_rss_bytes_max": max(host, default=None)},
    }
    if "passed" in r:
        kept["passed"] = r["passed"]
        kept["failed_gates"] = [g["name"] for g in r.get("gates", []) if not g.get("passed")]
    return kept


def snapshot_progress(stage_dir: Path) -> dict | None:
    """A stopped stage's progress from its last resume snapshot (rank 0): layers done and their costs."""
    states = sorted(stage_dir.glob("rank0/layer_*/state.json"))
    if not states:
        return None
    snap = json.loads(states[-1].read_text())
    state = snap.get("state") or {}
    return {"last_layer": snap.get("layer"), "layer_seconds": state.get("layer_seconds"),
            "layer_memory": state.get("layer_memory")}


def projection(layer_seconds: list[float], moe: list[bool], stage_seconds: float | None = None) -> dict | None:
    """The whole-K2.6 PROJECTION (1 dense + 60 MoE layers) from measured per-layer seconds; None without a measured
    MoE and dense layer. `stage_seconds` (the report's): adds the measured time outside the layers (data, logits...)."""
    moe_s = [s for s, m in zip(layer_seconds, moe) if m]
    dense_s = [s for s, m in zip(layer_seconds, moe) if not m]
    if not moe_s or not dense_s:
        return None
    per_moe = statistics.median(moe_s)
    return {"projection": True, "moe_layer_seconds_median": round(per_moe, 3),
            "dense_layer_seconds": round(dense_s[0], 3), "measured_moe_layers": len(moe_s),
            "k26_layers_seconds": round(per_moe * K26_MOE_LAYERS + dense_s[0], 1),
            "non_layer_seconds_measured":
                None if stage_seconds is None else round(stage_seconds - sum(layer_seconds), 1)}


def moe_layers(src: Path) -> list[bool]:
    from kimi_nvfp4.checkpoint.reader import CheckpointReader

    cfg = CheckpointReader(src).layout.text
    return [cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)]


def _args():
    ap = bench_parser(__doc__)
    ap.add_argument("--preset", choices=["k2.6", "tiny"], default="k2.6")
    ap.add_argument("--layers", type=int, default=61)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--vocab-size", type=int, default=None, help="default: synth's (the full 163840)")
    ap.add_argument("--source-dir", type=Path, default=None,
                    help="where SRC is synthesized and kept for the next run (e.g. /dev/shm/k26_src)")
    ap.add_argument("--work-dir", type=Path, default=Path("/tmp/rehearsal"), help="OUT, the validate report, logs")
    ap.add_argument("--device", default="cuda", help="--device of convert, calibrate and validate")
    ap.add_argument("--synth-device", default=None, help="synth's --device (default: --device)")
    ap.add_argument("--synth-workers", type=int, default=4)
    ap.add_argument("--data", default="builtin", help="--data of calibrate and validate")
    for stage in ("convert", "calibrate", "validate"):
        ap.add_argument(f"--{stage}-args", default="",
                        help=f"more options for {stage}, one string (--{stage}-args=--opt for one without a space)")
    ap.add_argument("--stage-timeout", type=float, default=3600.0, help="seconds per stage")
    ap.add_argument("--total-timeout", type=float, default=None,
                    help="seconds for the whole run: each stage gets at most what is left")
    ap.add_argument("--disk-gib", type=float, default=4.0, help="bytes written to measure the disk (0: skip)")
    ap.add_argument("--disk-writers", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--keep", action="store_true", help="keep OUT (and a SRC made under --work-dir)")
    return ap.parse_args()


def main() -> dict:
    # the handler is the run's own: restored on return, so a caller (a test, another script) keeps its SIGTERM
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        return _main()
    finally:
        signal.signal(signal.SIGTERM, previous)


def _main() -> dict:
    args = _args()
    started = time.perf_counter()
    work = args.work_dir.resolve()
    name = f"{args.preset}_{args.layers}l_{args.experts}e" + (f"_{args.vocab_size}v" if args.vocab_size else "")
    src_root = args.source_dir.resolve() if args.source_dir else work / "src"
    src, out, report_dir, logs = src_root / name, work / "out", work / "validate_report", work / "logs"
    for stale in (out, report_dir, logs):
        shutil.rmtree(stale, ignore_errors=True)
    py = [sys.executable, "-m", "kimi_nvfp4"]
    record = {"preset": args.preset, "layers": args.layers, "experts": args.experts, "vocab_size": args.vocab_size,
              "stage_device": args.device, "data": args.data, "source": str(src), "output": str(out), "stages": {},
              "free_bytes_before": {"source": free_bytes(src_root), "work": free_bytes(work)}}

    def save() -> None:
        record["wall_s"] = round(time.perf_counter() - started, 1)
        write_result(args.json, record, device=args.device)

    def timeout() -> float:
        left = None if args.total_timeout is None else args.total_timeout - (time.perf_counter() - started)
        return max(1.0, args.stage_timeout if left is None else min(args.stage_timeout, left))

    synth_args = {"preset": args.preset, "layers": args.layers, "experts": args.experts,
                  "vocab_size": args.vocab_size, "device": args.synth_device or args.device}
    done_marker = src_root / f"{name}.{SYNTH_DONE}"
    try:
        if done_marker.is_file() and json.loads(done_marker.read_text()) == synth_args and src.is_dir():
            record["stages"]["synth"] = {"skipped": "a finished checkpoint is already there"}
        else:
            done_marker.unlink(missing_ok=True)
            shutil.rmtree(src, ignore_errors=True)  # a partial one of an interrupted run
            src_root.mkdir(parents=True, exist_ok=True)
            argv = [*py, "synth", str(src), "--preset", args.preset, "--layers", str(args.layers), "--experts",
                    str(args.experts), "--shards", str(args.layers + 3), "--shard-layout", "release",
                    "--device", synth_args["device"], "--workers", str(args.synth_workers)]
            if args.vocab_size:
                argv += ["--vocab-size", str(args.vocab_size)]
            record["stages"]["synth"] = run_stage("synth", argv, timeout(), logs)
            if record["stages"]["synth"]["exit_code"] != 0:
                raise RuntimeError("synth failed")
            done_marker.write_text(json.dumps(synth_args))
        record["source_bytes"] = folder_bytes(src)
        work.mkdir(parents=True, exist_ok=True)
        if args.disk_gib > 0:
            nbytes = int(args.disk_gib * 2**30)
            record["disk_write_rate"] = {"folder": str(work), "fsync": True,
                                         "rows": [write_rate(work, nbytes, w) for w in args.disk_writers]}
            print("disk:", ", ".join(f"{r['writers']} writers {r['gb_per_s']:.2f} GB/s"
                                     for r in record["disk_write_rate"]["rows"]), flush=True)
        save()
        device = ["--device", args.device, "--no-progress"]
        stages = {
            "convert": ([*py, "convert", str(src), str(out), *device, "--json"], None, None),
            "calibrate": ([*py, "calibrate", str(out), "--source", str(src), "--data", args.data, *device],
                          out / "calibration" / "calibration_report.json", out / ".kimi_nvfp4_resume" / "calibrate"),
            "validate": ([*py, "validate", str(out), "--source", str(src), "--data", args.data, "--report",
                          str(report_dir), *device], report_dir / "validate_report.json",
                         report_dir / ".kimi_nvfp4_resume" / "validate"),
        }
        for stage, (argv, report, resume_dir) in stages.items():
            entry = run_stage(stage, argv + shlex.split(getattr(args, f"{stage}_args")), timeout(), logs)
            record["stages"][stage] = entry
            if stage == "convert":
                try:
                    entry["summary"] = json.loads((logs / "convert.stdout").read_text())
                except ValueError:
                    entry["summary"] = None
            else:
                entry["report"] = stage_report(report)
                if entry["report"] is None and resume_dir is not None:
                    entry["progress_from_snapshot"] = snapshot_progress(resume_dir)
            save()
            if stage == "convert" and entry["exit_code"] != 0:
                break  # nothing to calibrate or validate
        record["output_bytes"] = folder_bytes(out)
    except Interrupted as e:
        record["interrupted"] = str(e)
    except RuntimeError as e:
        record["error"] = str(e)
    record["free_bytes_after"] = {"source": free_bytes(src_root), "work": free_bytes(work)}
    summarize(record, src)
    save()
    if not args.keep:
        shutil.rmtree(out, ignore_errors=True)
        if args.source_dir is None:
            shutil.rmtree(src_root, ignore_errors=True)
    return record


def summarize(record: dict, src: Path) -> None:
    """The compact per-stage summary, and the K2.6 projection where measured layers allow one."""
    def gib(b):
        return "-" if b is None else f"{b / 2**30:.1f} GiB" if b >= 2**30 else f"{b / 2**20:.0f} MiB"

    print(f"\nrehearsal: {record['layers']} layers x {record['experts']} experts ({record['preset']}), "
          f"SRC {gib(record.get('source_bytes'))}, OUT {gib(record.get('output_bytes'))}")
    for stage, e in record["stages"].items():
        if "skipped" in e:
            print(f"  {stage:9s} skipped: {e['skipped']}")
            continue
        status = "timed out" if e.get("timed_out") else f"exit {e.get('exit_code')}"
        line = (f"  {stage:9s} {status:10s} {e.get('wall_s', 0):8.1f} s  "
                f"child RSS peak {gib(e.get('child_peak_rss_bytes'))}  "
                f"GPU used peak {gib(e.get('gpu_used_peak_bytes'))}")
        rep = e.get("report")
        if rep:
            t = rep["totals"]
            line += (f"  | {t['layers']} layers {t['layer_seconds_sum']} s, per-layer GPU peak max "
                     f"{gib(t['gpu_peak_bytes_max'])}, host RSS peak {gib(t['host_peak_rss_bytes_max'])}")
            proj = None
            if record["preset"] == "k2.6":  # a tiny model's layers say nothing of K2.6's
                try:
                    proj = projection(rep["layer_seconds"], moe_layers(src), rep["seconds"])
                except Exception:  # noqa: BLE001 - the source may be gone; no projection then
                    proj = None
            if proj is not None:
                rep["projection_k26_depth"] = proj
                line += (f"\n            PROJECTION (not measured) for K2.6's 61 layers at {record['experts']} experts "
                         f"per layer: {proj['k26_layers_seconds']} s of layers (median MoE layer "
                         f"{proj['moe_layer_seconds_median']} s x 60 + dense {proj['dense_layer_seconds']} s; "
                         f"+ {proj['non_layer_seconds_measured']} s measured outside the layers)")
        print(line)
    for key in ("interrupted", "error"):
        if key in record:
            print(f"  {key}: {record[key]}")


if __name__ == "__main__":
    main()
