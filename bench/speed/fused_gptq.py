"""calibrate --method gptq (fused, statistics in memory) against calibrate --expert-stats hessian + requantize
--no-recalibrate on the demo checkpoint, CPU: wall time, statistics bytes written, shard equality.

    python -m bench.speed.fused_gptq --json bench/results/fused_gptq_demo_cpu.json
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path

from bench.harness.results import bench_parser, write_result
from kimi_nvfp4.calibrate import calibrate_checkpoint
from kimi_nvfp4.checkpoint.manifest import load_manifest
from kimi_nvfp4.convert.api import convert_checkpoint
from kimi_nvfp4.demo_model import DEMO_CHECKPOINT
from kimi_nvfp4.requantize import requantize_checkpoint


def _bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) if folder.exists() else 0


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=256)
    args = parser.parse_args()
    kw = dict(samples=args.samples, seq_len=args.seq_len, device="cpu", progress=False)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        base = root / "converted"
        convert_checkpoint(DEMO_CHECKPOINT, base, device="cpu", progress=False)
        two, fused = root / "two", root / "fused"
        shutil.copytree(base, two)
        shutil.copytree(base, fused)
        t = time.perf_counter()
        calibrate_checkpoint(two, DEMO_CHECKPOINT, "sample", expert_stats="hessian", **kw)
        calibrate_s = time.perf_counter() - t
        stats_bytes = _bytes(two / "calibration" / "expert_stats")
        t = time.perf_counter()
        requantize_checkpoint(two, DEMO_CHECKPOINT, method="gptq", device="cpu", recalibrate=False, progress=False)
        requantize_s = time.perf_counter() - t
        t = time.perf_counter()
        calibrate_checkpoint(fused, DEMO_CHECKPOINT, "sample", method="gptq", **kw)
        fused_s = time.perf_counter() - t
        same = {f: r.sha256 for f, r in load_manifest(two).shards.items()} == \
            {f: r.sha256 for f, r in load_manifest(fused).shards.items()}
        result = {"checkpoint": "demo (kimi_nvfp4/assets/tiny_k2)", "device": "cpu", "samples": args.samples,
                  "seq_len": args.seq_len, "two_stage_calibrate_s": round(calibrate_s, 2),
                  "two_stage_requantize_s": round(requantize_s, 2), "fused_calibrate_s": round(fused_s, 2),
                  "two_stage_statistics_bytes": stats_bytes,
                  "fused_statistics_bytes": _bytes(fused / "calibration" / "expert_stats"),
                  "shards_identical": same}
    print(json.dumps(write_result(args.json, result, device="cpu"), indent=2))


if __name__ == "__main__":
    main()
