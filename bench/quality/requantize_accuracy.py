"""Output-aware requantization on the demo model (issue 16): amax / int4-aware vs act-diag / gptq / gptq-w4a4
after `requantize`, validate's own metrics over several held-out draws, CPU.

Per method: convert (amax or int4-aware); for act-diag and gptq, the int4-aware conversion calibrated with
`--expert-stats hessian` (gptq-w4a4: `w4a4`) and then `requantize --method M` (which recalibrates the input scales); the others
calibrated with the same data and settings. Then validate (W4A16 and W4A4, SGLang's layer-max input-scale
reduction) on `--seeds` held-out draws of `--validate-samples` x `--seq-len` tokens each. Prints a JSON row per
(method, seed), then the mean and spread per method, and writes all to --json.

    python -m bench.quality.requantize_accuracy --work-dir /tmp/kimi_nvfp4_requant \\
        --json bench/results/requantize_accuracy_demo_cpu.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from bench.harness.provenance import demo_cpu_header
from bench.harness.heldout import calibration_keywords, draw_spread, prepare_method

MODES = ("w4a16", "w4a4")
def _summary(rows: list[dict], method: str) -> dict:
    mine = [r for r in rows if r["method"] == method]
    return {"method": method, "seeds": [r["seed"] for r in mine], **draw_spread(mine)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work-dir", type=Path, default=Path("/tmp/kimi_nvfp4_requant"))
    ap.add_argument("--data", default="builtin")
    ap.add_argument("--samples", type=int, default=64, help="calibration sequences")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--min-expert-tokens", type=int, default=64)
    ap.add_argument("--validate-samples", type=int, default=32)
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--methods", nargs="+", default=["amax", "int4-aware", "act-diag", "gptq"])
    ap.add_argument("--json", type=Path, default=Path("bench/results/requantize_accuracy_demo_cpu.json"))
    args = ap.parse_args()

    from kimi_nvfp4.demo_model import DEMO_CHECKPOINT
    from kimi_nvfp4.validate import validate_checkpoint

    calibration = calibration_keywords(args)
    folders, seconds, stats = {}, {}, {}
    for method in args.methods:
        t0 = time.perf_counter()
        folders[method], found = prepare_method(method, args.work_dir, args.data, calibration)
        if found is not None:
            stats[method] = found
        seconds[method] = time.perf_counter() - t0

    rows = []
    for method, out in folders.items():
        for seed in args.seeds:
            v = validate_checkpoint(out, DEMO_CHECKPOINT, args.data, report_dir=out / f"validate_{seed}",
                                    samples=args.validate_samples, seq_len=args.seq_len, seed=seed,
                                    modes=list(MODES), device="cpu", progress=False, record_in_manifest=False)
            row = {"method": method, "seed": seed, "tokens": v.tokens, "passed": v.passed}
            for e in v.end_to_end:
                row[e.mode] = {"kl_mean": e.kl_mean, "kl_p99": e.kl_p99, "top1": e.top1, "ppl_ratio": e.ppl_ratio}
            print(json.dumps(row), flush=True)
            rows.append(row)
    summaries = [_summary(rows, m) for m in folders]
    for s in summaries:
        print(json.dumps(s), flush=True)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({
        **demo_cpu_header(args),
        "prepare_seconds": seconds, "statistics": stats, "rows": rows, "summary": summaries,
    }, indent=2))


if __name__ == "__main__":
    main()
