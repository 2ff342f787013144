"""Layer-local errors of the requantized experts on the demo model: in-sample and on other tokens (issue 16).

For each routed expert matrix with dense statistics, the served (W4A4) error E||W x - Q x~||^2 and the W4A16 error
E||W x - Q x||^2 against the INT4 weights W (`output_aware/output_error.py`), summed over the experts of each input
(gate/up, down), as a multiple of int4-aware's. Two sets of statistics, both from `calibrate --expert-stats w4a4`
on the int4-aware conversion: the calibration the methods were fitted on (calibrate's seed 0: in-sample), and the
same number of other calibration-part sequences (`--other-seed`, checked to share no sequence with seed 0). Reads
the checkpoints a run of bench.quality.vs_modelopt left in `--work-dir` (one folder per method, and
`int4-aware+w4a4`).

    python -m bench.experiments.w4a4_floor.layer_error --work-dir /tmp/a4_vs \\
        --json bench/results/w4a4_layer_error_demo_cpu.json
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch

from bench.harness.layer_error import expert_layer_errors
from bench.harness.provenance import demo_cpu_header

BASE_METHOD = "int4-aware"
STATS_FOLDER = "int4-aware+w4a4"  # bench_requantize_accuracy.prepare_method's base for the w4a4 methods


def _other_statistics(work_dir: Path, data: str, samples: int, seq_len: int, seed: int) -> Path:
    from kimi_nvfp4.calibrate import calibrate_checkpoint
    from kimi_nvfp4.demo_model import DEMO_CHECKPOINT

    out = work_dir / f"{STATS_FOLDER}+seed{seed}"
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(work_dir / STATS_FOLDER, out)
    calibrate_checkpoint(out, DEMO_CHECKPOINT, data, samples=samples, seq_len=seq_len, min_expert_tokens=64,
                         seed=seed, device="cpu", progress=False, expert_stats="w4a4")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work-dir", type=Path, default=Path("/tmp/kimi_nvfp4_vs_modelopt"))
    ap.add_argument("--data", default="builtin")
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--other-seed", type=int, default=1)
    ap.add_argument("--methods", nargs="+", default=["int4-aware", "gptq", "gptq-w4a4", "gptq-w4a4-diag"])
    ap.add_argument("--json", type=Path, default=Path("bench/results/w4a4_layer_error_demo_cpu.json"))
    args = ap.parse_args()

    from kimi_nvfp4.calibrate.options import CalibrateOptions
    from kimi_nvfp4.stage_kit.samples import DataPart, load_sample_set

    fitted_seed = CalibrateOptions().seed
    draws = {seed: load_sample_set(args.work_dir / BASE_METHOD, args.data, part=DataPart.CALIBRATION,
                                   samples=args.samples, seq_len=args.seq_len, seed=seed).sequences
             for seed in (fitted_seed, args.other_seed)}
    shared = sum(any(torch.equal(x, y) for y in draws[fitted_seed]) for x in draws[args.other_seed])
    checkpoints = {m: args.work_dir / m for m in dict.fromkeys([BASE_METHOD, *args.methods])}
    other = _other_statistics(args.work_dir, args.data, args.samples, args.seq_len, args.other_seed)
    result = {"in-sample": expert_layer_errors(args.work_dir / STATS_FOLDER, checkpoints),
              "other tokens": expert_layer_errors(other, checkpoints)}
    rows = []
    for which, totals in result.items():
        for key, value in totals.items():
            group, mode, method = key.split(".", 2)
            base = totals[f"{group}.{mode}.{BASE_METHOD}"]
            rows.append({"statistics": which, "input": group, "mode": mode, "method": method, "error": value,
                         "vs_int4_aware": value / base})
            print(json.dumps(rows[-1]), flush=True)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({
        **demo_cpu_header(args),
        "settings": {"fitted_seed": fitted_seed, "other_seed": args.other_seed, "samples": args.samples,
                     "seq_len": args.seq_len, "sequences_shared": shared},
        "rows": rows,
    }, indent=2))


if __name__ == "__main__":
    main()
