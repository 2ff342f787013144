"""Which inputs should the next layer see when calibrate solves gptq in its layer loop? (issue 26)

`calibrate --method gptq` propagates, by default, the layer as convert wrote it (int4-aware weights, W4A4 with the
chosen input scales: `--propagation int4`); sequential GPTQ (the GPTQ paper, llm-compressor) feeds the next layer
from the requantized layer instead (`--propagation sequential`), so later layers' statistics and input scales see
the inputs the final model produces. Rows, on the bundled demo model, calibrated alike (`--samples` x `--seq-len`):

- `amax`: `convert --method amax` + calibrate (the baseline);
- `int4-aware`: `convert` + calibrate (the experts as converted);
- `gptq, int4 propagation`: `convert` + `calibrate --method gptq` (today's default);
- `gptq, sequential propagation`: `convert` + `calibrate --method gptq --propagation sequential`;
- `gptq, two-stage (recalibrated)`: `calibrate --expert-stats hessian` + `requantize --method gptq` (its
  recalibration refreshes every input scale with the requantized experts; for reference).

Each row's held-out KL / top-1 in W4A16 and W4A4 (bench.harness.heldout: validate's emulation, one INT4 reference
per draw), per draw, with paired ratios per draw of sequential over int4 propagation. `weight-induced W4A4 KL`:
a row's W4A4 KL minus the activation-only floor of the same draw (exact INT4 weights, all expert inputs quantized,
from `--floor` = bench/results/w4a4_floor_demo_cpu.json, same draws and protocol), as docs/benchmarks.md §13.4
uses it; the floor's input scales are its own calibration's, so this part is approximate, but it is the same
subtrahend for both propagation rows.

    python -m bench.experiments.gptq_propagation.compare --json bench/results/gptq_propagation_demo_cpu.json
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from bench.harness.heldout import add_draw_arguments, calibration_keywords, draw_settings, draw_spread, heldout_figures, \
    heldout_sequences, prepare_method
from bench.harness.prepared import PreparedFolders, calibrated_folder
from bench.harness.results import bench_parser, write_result

ROWS = ("amax", "int4-aware", "gptq, int4 propagation", "gptq, sequential propagation",
        "gptq, two-stage (recalibrated)")
INT4, SEQUENTIAL = "gptq, int4 propagation", "gptq, sequential propagation"
FLOOR_ROW = "exact weights, all inputs quantized (floor)"
FLOOR_FILE = Path("bench/results/w4a4_floor_demo_cpu.json")


def _converted(work: Path, name: str, method: str = "int4-aware") -> Path:
    from kimi_nvfp4.convert import convert_checkpoint
    from kimi_nvfp4.demo_model import DEMO_CHECKPOINT

    out = work / name
    shutil.rmtree(out, ignore_errors=True)
    convert_checkpoint(DEMO_CHECKPOINT, out, device="cpu", progress=False, method=method)
    return out


def _calibrated(work: Path, name: str, data: str, calibration: dict, method: str = "int4-aware", **extra) -> Path:
    from kimi_nvfp4.calibrate import calibrate_checkpoint
    from kimi_nvfp4.demo_model import DEMO_CHECKPOINT

    out = _converted(work, name, method)
    calibrate_checkpoint(out, DEMO_CHECKPOINT, data, **calibration, **extra)
    return out


def _floor(path: Path) -> dict[int, float]:
    """Per held-out seed, the activation-only W4A4 KL floor of the w4a4_floor result file (empty if absent)."""
    if not path.is_file():
        return {}
    record = json.loads(path.read_text())
    return {r["seed"]: r["w4a4"]["kl_mean"] for r in record["rows"] if r["row"] == FLOOR_ROW}


def main() -> None:
    ap = bench_parser(__doc__.splitlines()[0], json_default="bench/results/gptq_propagation_demo_cpu.json")
    add_draw_arguments(ap, work_dir="/tmp/kimi_nvfp4_gptq_propagation")
    ap.add_argument("--floor", type=Path, default=FLOOR_FILE, help="w4a4_floor result file (per-draw floor)")
    ap.add_argument("--reuse", action="store_true", help="take the rows' calibrated folders already in --work-dir")
    ap.add_argument("--skip-two-stage", action="store_true", help="leave out the two-stage reference row")
    args = ap.parse_args()

    from kimi_nvfp4.demo_model import DEMO_CHECKPOINT

    started = time.perf_counter()
    work = args.work_dir
    work.mkdir(parents=True, exist_ok=True)
    calibration = calibration_keywords(args)
    timed = PreparedFolders(calibrated_folder if args.reuse else None)

    checkpoints = {
        "amax": timed("amax", _calibrated, work, "amax", args.data, calibration, method="amax"),
        "int4-aware": timed("int4-aware", _calibrated, work, "int4-aware", args.data, calibration),
        INT4: timed(INT4, _calibrated, work, "gptq-int4", args.data, {**calibration, "method": "gptq"}),
        SEQUENTIAL: timed(SEQUENTIAL, _calibrated, work, "gptq-sequential", args.data,
                          {**calibration, "method": "gptq", "propagation": "sequential"}),
    }
    if not args.skip_two_stage:
        checkpoints["gptq, two-stage (recalibrated)"] = timed(
            "two-stage", lambda: prepare_method("gptq", work / "two-stage", args.data, calibration)[0])

    floor = _floor(args.floor)
    rows, paired = [], []
    for seed in args.seeds:
        sequences = heldout_sequences(checkpoints["int4-aware"], args.data, samples=args.validate_samples,
                                      seq_len=args.seq_len, seed=seed)
        figures = heldout_figures(checkpoints, DEMO_CHECKPOINT, sequences)
        for name, modes in figures.items():
            row = {"row": name, "seed": seed, **modes}
            if seed in floor:
                row["w4a4_weight_induced_kl"] = modes["w4a4"]["kl_mean"] - floor[seed]
            rows.append(row)
            print(json.dumps(row), flush=True)
        pair = {"seed": seed}
        for mode in ("w4a16", "w4a4"):
            for metric in ("kl_mean", "kl_p99"):
                pair[f"{mode}.{metric}"] = figures[SEQUENTIAL][mode][metric] / figures[INT4][mode][metric]
            pair[f"{mode}.top1_delta"] = figures[SEQUENTIAL][mode]["top1"] - figures[INT4][mode]["top1"]
        if seed in floor:
            pair["w4a4_weight_induced_kl"] = (figures[SEQUENTIAL]["w4a4"]["kl_mean"] - floor[seed]) / (
                figures[INT4]["w4a4"]["kl_mean"] - floor[seed])
        paired.append(pair)
        print(json.dumps({"sequential_over_int4": pair}), flush=True)

    summary = []
    for name in checkpoints:
        mine = [r for r in rows if r["row"] == name]
        entry = {"row": name, **draw_spread(mine)}
        induced = [r["w4a4_weight_induced_kl"] for r in mine if "w4a4_weight_induced_kl" in r]
        if induced:
            entry["w4a4_weight_induced_kl"] = {"mean": sum(induced) / len(induced), "min": min(induced),
                                               "max": max(induced)}
        summary.append(entry)
    keys = [k for k in paired[0] if k != "seed"]
    wins = {k: sum(1 for p in paired if (p[k] > 0 if k.endswith("top1_delta") else p[k] < 1)) for k in keys}
    write_result(args.json, {
        "model": "demo (kimi_nvfp4/assets/tiny_k2)",
        "settings": {**draw_settings(args, min_expert_tokens=args.min_expert_tokens),
                     "floor_file": str(args.floor) if floor else None},
        "prepare_seconds": timed.seconds, "rows": rows, "summary": summary,
        "sequential_over_int4": {"per_draw": paired, "draws_sequential_better": wins, "draws": len(paired)},
        "total_seconds": time.perf_counter() - started,
    }, device="cpu")


if __name__ == "__main__":
    main()
