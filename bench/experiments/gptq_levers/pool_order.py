"""Two more gptq levers on the demo model (issue 26 goal 3): pooling each expert's Hessian with the layer's, and
quantizing whole NVFP4 blocks in order of their input energy.

- `pool_tokens k` (gate/up only): H_e' = (n_e H_e + k H_pool) / (n_e + k), H_pool the layer's statistics of the
  same input over all tokens (`shared.gate_up`, both shrunk as gptq shrinks H). Down has no pooled statistics:
  each expert's intermediate channels are its own, so a mean over experts would mix unrelated channels.
- `block_order`: act-order restricted to whole 16-column blocks (the NVFP4 scale groups unchanged).

Same protocol as levers.py (same calibration, the 4 held-out draws); `amax` and the W4A4 floor per draw are read
from bench/results/w4a4_floor_demo_cpu.json (same calibration and draws; its gptq row is reproduced here and
checked), so the W4A4 weight-induced part is `KL - floor` and the goal figures are paired ratios to amax's.

    python -m bench.experiments.gptq_levers.pool_order --seeds 1 2 3 4 --json bench/results/gptq_levers2_demo_cpu.json

`--variants NAME ...` measures only the named rows (default: all of `variant_names()`; int4-aware's layer errors are
computed anyway: they are the unit of the others'). The floor file has draws 1-4 only: other draws need
`--measure-references`, which measures amax and the floor of every draw in the same run (`measure_references`, as
`--references` does) instead of reading the file. The confirmation of pool_tokens 256 on fresh draws:

    python -m bench.experiments.gptq_levers.pool_order --seeds 5 6 7 8 --measure-references \
        --variants gptq "gptq, pool_tokens 256" --json bench/results/gptq_pool256_fresh_draws_demo_cpu.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from bench.experiments.gptq_levers.levers import _calibrated, _requantized
from bench.harness.heldout import add_draw_arguments, calibration_keywords, draw_settings, draw_spread, heldout_figures, \
    heldout_sequences
from bench.harness.layer_error import expert_layer_errors, relative_layer_errors
from bench.harness.prepared import PreparedFolders
from bench.harness.provenance import demo_cpu_header
from bench.harness.results import write_result

FLOOR_FILE = Path("bench/results/w4a4_floor_demo_cpu.json")
FLOOR_ROW = "exact weights, all inputs quantized (floor)"
POOL_TOKENS = (64, 256, 1024, 4096)
METRICS = ("kl_mean", "kl_p99", "top1")


def lever_options() -> dict[str, dict]:
    rows = {f"gptq, pool_tokens {k}": {"pool_tokens": k} for k in POOL_TOKENS}
    rows["gptq, block_order"] = {"block_order": True}
    rows["gptq, pool_tokens 1024 + block_order"] = {"pool_tokens": 1024, "block_order": True}
    return rows


def variant_names() -> list[str]:
    """Every row the bench measures, in its order: int4-aware (the unit of the layer errors), gptq, the levers."""
    return ["int4-aware", "gptq", *lever_options()]


def selected_variants(names: list[str] | None) -> list[str]:
    """`names` in `variant_names()`'s order (all of them for None or none); ValueError naming the valid ones
    otherwise."""
    valid = variant_names()
    if not names:
        return valid
    unknown = [n for n in names if n not in valid]
    if unknown:
        raise ValueError(f"unknown variant(s) {', '.join(map(repr, unknown))}; valid: {', '.join(map(repr, valid))}")
    return [n for n in valid if n in names]


def reference_draws() -> dict[int, dict]:
    """Per held-out draw: amax's W4A16 / W4A4 KL, the W4A4 floor and gptq's figures from the floor bench."""
    rows = json.loads(FLOOR_FILE.read_text())["rows"]
    out: dict[int, dict] = {}
    for r in rows:
        d = out.setdefault(r["seed"], {})
        if r["row"] == "amax":
            d["amax_w4a16"], d["amax_w4a4"] = r["w4a16"]["kl_mean"], r["w4a4"]["kl_mean"]
        elif r["row"] == FLOOR_ROW:
            d["floor"] = r["w4a4"]["kl_mean"]
        elif r["row"] == "gptq":
            d["gptq_w4a16"], d["gptq_w4a4"] = r["w4a16"]["kl_mean"], r["w4a4"]["kl_mean"]
    return out


def paired(row: dict, ref: dict) -> dict:
    w16, w4 = row["w4a16"]["kl_mean"], row["w4a4"]["kl_mean"]
    return {"w4a16_kl_vs_amax": w16 / ref["amax_w4a16"], "w4a4_kl_vs_amax": w4 / ref["amax_w4a4"],
            "w4a4_weight_part": w4 - ref["floor"],
            "w4a4_weight_part_vs_amax": (w4 - ref["floor"]) / (ref["amax_w4a4"] - ref["floor"])}


@torch.no_grad()
def measure_references(args) -> dict[int, dict]:
    """amax's W4A16 / W4A4 KL and the W4A4 floor (exact INT4 weights, every expert input NVFP4-quantized with
    static scales: bench/experiments/w4a4_floor) per held-out draw, with the code as it is now (the floor file's
    rows predate changes in calibrate and gptq: its gptq row no longer reproduces)."""
    from bench.experiments.w4a4_floor.activation_floor import INPUTS, FloorWeights, InputTransform, WeightRule
    from bench.experiments.w4a4_floor.activation_floor import calibrate_floor_scales
    from bench.experiments.w4a4_floor.floor import _compare
    from bench.harness.heldout import _runner, prepare_method
    from kimi_nvfp4.calibrate.expert_stats_file import EXPERT_STATS_DIR, read_layer_stats
    from kimi_nvfp4.calibrate.options import CalibrateOptions
    from kimi_nvfp4.checkpoint.reader import CheckpointReader
    from kimi_nvfp4.demo_model import DEMO_CHECKPOINT
    from kimi_nvfp4.model import Int4SourceWeights
    from kimi_nvfp4.stage_kit.samples import DataPart, load_sample_set

    calibration = calibration_keywords(args)
    amax = args.work_dir / "amax"
    if not (args.reuse and amax.exists()):
        amax, _ = prepare_method("amax", args.work_dir, args.data, calibration)
    stats_dir = args.work_dir / "int4-aware+hessian" / "calibration" / EXPERT_STATS_DIR
    stats = {s.layer: s for s in (read_layer_stats(p) for p in sorted(stats_dir.glob("layer_*.safetensors")))}
    calib = load_sample_set(amax, args.data, part=DataPart.CALIBRATION, samples=args.samples, seq_len=args.seq_len,
                            seed=CalibrateOptions().seed)
    floor = FloorWeights(CheckpointReader(DEMO_CHECKPOINT), rule=WeightRule.EXACT, transform=InputTransform(),
                         quantized=INPUTS, stats=stats)
    calibrate_floor_scales(floor, calib.sequences, _runner)
    out = {}
    for seed in args.seeds:
        sequences = heldout_sequences(amax, args.data, samples=args.validate_samples, seq_len=args.seq_len, seed=seed)
        modes = heldout_figures({"amax": amax}, DEMO_CHECKPOINT, sequences)["amax"]
        reference = list(_runner(Int4SourceWeights(CheckpointReader(DEMO_CHECKPOINT))).run(sequences))
        out[seed] = {"amax_w4a16": modes["w4a16"]["kl_mean"], "amax_w4a4": modes["w4a4"]["kl_mean"],
                     "floor": _compare(floor, sequences, reference)["kl_mean"], "amax": modes}
        print(json.dumps({"seed": seed, **out[seed]}), flush=True)
    return out


def summarize(rows: list[dict], names) -> list[dict]:
    gptq = {r["seed"]: r for r in rows if r["row"] == "gptq"}
    summary = []
    for name in names:
        mine = [r for r in rows if r["row"] == name]
        entry = {"row": name, **draw_spread(mine, METRICS)}
        for key in ("w4a16_kl_vs_amax", "w4a4_kl_vs_amax", "w4a4_weight_part", "w4a4_weight_part_vs_amax"):
            entry[key] = statistics.fmean(r[key] for r in mine)
        entry["draws_better_than_gptq"] = {
            mode: sum(r[mode]["kl_mean"] < gptq[r["seed"]][mode]["kl_mean"] for r in mine) for mode in ("w4a16", "w4a4")}
        entry["weight_part_vs_amax_per_draw"] = [r["w4a4_weight_part_vs_amax"] for r in mine]
        entry["w4a16_vs_amax_per_draw"] = [r["w4a16_kl_vs_amax"] for r in mine]
        summary.append(entry)
    return summary


def add_references(args) -> None:
    """Re-pair the result file's rows with amax and the floor measured now (`measure_references`)."""
    cache = args.work_dir / "references.json"
    t0 = time.perf_counter()
    if args.reuse and cache.exists():
        refs = {int(k): v for k, v in json.loads(cache.read_text()).items()}
    else:
        refs = measure_references(args)
        cache.write_text(json.dumps(refs))
    if not args.json.exists():
        print(f"measured; {args.json} not written yet: run again with --reuse once it is")
        return
    record = json.loads(args.json.read_text())
    rows = [{**r, **paired(r, refs[r["seed"]])} for r in record["rows"]]
    names = list(dict.fromkeys(r["row"] for r in rows))
    layer_error = {s["row"]: s.get("layer_error_other_tokens_vs_int4_aware") for s in record["summary"]}
    summary = [{"row": s["row"], "layer_error_other_tokens_vs_int4_aware": layer_error[s["row"]], **s}
               for s in summarize(rows, names)]
    record["settings"]["reference"] = {
        "measured_with": demo_cpu_header(args)["command"], "floor": "exact INT4 weights, all expert inputs quantized",
        "floor_file_gptq_reproduced_exactly": record["settings"]["reference"]["gptq_reproduced_exactly"]}
    record.update(reference_draws={seed: {k: v for k, v in d.items() if k != "amax"} for seed, d in refs.items()},
                  amax_rows=[{"row": "amax", "seed": seed, **d["amax"]} for seed, d in refs.items()],
                  rows=rows, summary=summary, reference_seconds=time.perf_counter() - t0)
    args.json.write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps([{k: s[k] for k in ("row", "w4a16_kl_vs_amax", "w4a4_weight_part_vs_amax",
                                         "draws_better_than_gptq")} for s in summary], indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_draw_arguments(ap, work_dir="/tmp/kimi_nvfp4_gptq_levers2")
    ap.add_argument("--other-seed", type=int, default=1, help="calibration-part draw for the layer errors")
    ap.add_argument("--json", type=Path, default=Path("bench/results/gptq_levers2_demo_cpu.json"))
    ap.add_argument("--reuse", action="store_true", help="keep the checkpoints an earlier run left in --work-dir")
    ap.add_argument("--references", action="store_true",
                    help="measure amax and the W4A4 floor now and re-pair the rows already in --json with them")
    ap.add_argument("--variants", nargs="+", metavar="NAME", default=[],  # []: left out of the recorded command
                    help="measure only these rows (default: all): " + ", ".join(map(repr, variant_names())))
    ap.add_argument("--measure-references", action="store_true",
                    help=f"measure amax and the W4A4 floor of every draw in this run instead of reading {FLOOR_FILE} "
                         "(which has draws 1-4 only)")
    args = ap.parse_args()
    try:
        variants = selected_variants(args.variants)
    except ValueError as e:
        ap.error(str(e))
    if not (args.references or args.measure_references):
        missing = sorted(set(args.seeds) - set(reference_draws()))
        if missing:
            ap.error(f"draws {missing} are not in {FLOOR_FILE} (it has {sorted(reference_draws())}): "
                     "pass --measure-references")
    if args.references:
        add_references(args)
        return

    from kimi_nvfp4.demo_model import DEMO_CHECKPOINT

    started = time.perf_counter()
    work = args.work_dir
    work.mkdir(parents=True, exist_ok=True)
    calibration = calibration_keywords(args)
    timed = PreparedFolders(Path.exists if args.reuse else None)

    base = timed("calibrate", _calibrated, work, "int4-aware+hessian", args.data, calibration, "hessian")
    other = timed("other statistics", _calibrated, work, "int4-aware+w4a4+other", args.data, calibration, "w4a4",
                  seed=args.other_seed)
    levers = {name: options for name, options in lever_options().items() if name in variants}
    checkpoints = {"int4-aware": base}  # always: the layer errors' unit
    if "gptq" in variants:
        checkpoints["gptq"] = timed("gptq", _requantized, work, "gptq", base)
    for i, (name, options) in enumerate(lever_options().items()):  # folder lever{i}: i over all the levers
        if name in levers:
            checkpoints[name] = timed(name, _requantized, work, f"lever{i}", base, options)
    layer_error = relative_layer_errors(expert_layer_errors(other, checkpoints))
    print(json.dumps(layer_error, indent=1), flush=True)

    reference_started = time.perf_counter()
    refs = measure_references(args) if args.measure_references else reference_draws()
    reference_seconds = time.perf_counter() - reference_started
    measured = {name: checkpoints[name] for name in variants}
    rows = []
    for seed in args.seeds:
        sequences = heldout_sequences(base, args.data, samples=args.validate_samples, seq_len=args.seq_len,
                                      seed=seed)
        for name, modes in heldout_figures(measured, DEMO_CHECKPOINT, sequences).items():
            rows.append({"row": name, "seed": seed, **modes, **paired(modes, refs[seed])})
            print(json.dumps(rows[-1]), flush=True)
    if args.measure_references:
        reference = {"measured_with": "this run (--measure-references: measure_references)",
                     "floor": "exact INT4 weights, all expert inputs quantized"}
    else:
        gptq_reproduced = all(
            r["w4a16"]["kl_mean"] == refs[r["seed"]]["gptq_w4a16"]
            and r["w4a4"]["kl_mean"] == refs[r["seed"]]["gptq_w4a4"]
            for r in rows if r["row"] == "gptq") if "gptq" in measured else None
        reference = {"file": str(FLOOR_FILE), "floor_row": FLOOR_ROW, "gptq_reproduced_exactly": gptq_reproduced}
    summary = []
    for name in measured:
        mine = [r for r in rows if r["row"] == name]
        gptq = {r["seed"]: r for r in rows if r["row"] == "gptq"}
        entry = {"row": name, "layer_error_other_tokens_vs_int4_aware": layer_error[name], **draw_spread(mine, METRICS)}
        for key in ("w4a16_kl_vs_amax", "w4a4_kl_vs_amax", "w4a4_weight_part", "w4a4_weight_part_vs_amax"):
            entry[key] = statistics.fmean(r[key] for r in mine)
        if gptq:
            entry["draws_better_than_gptq"] = {
                mode: sum(r[mode]["kl_mean"] < gptq[r["seed"]][mode]["kl_mean"] for r in mine)
                for mode in ("w4a16", "w4a4")}
        summary.append(entry)
    settings = {**draw_settings(args), "other_seed": args.other_seed, "method_options": levers,
                "reference": reference}
    if args.variants:
        settings["variants"] = variants
    record = {
        **demo_cpu_header(args),
        "settings": settings,
        "reference_draws": refs,
        "prepare_seconds": timed.seconds, "rows": rows, "summary": summary,
        "total_seconds": time.perf_counter() - started,
    }
    if args.measure_references:
        record.update(reference_draws={seed: {k: v for k, v in d.items() if k != "amax"} for seed, d in refs.items()},
                      amax_rows=[{"row": "amax", "seed": seed, **d["amax"]} for seed, d in refs.items()],
                      reference_seconds=reference_seconds)
    write_result(args.json, record)
    print(json.dumps([{k: s.get(k) for k in ("row", "w4a16_kl_vs_amax", "w4a4_weight_part_vs_amax",
                                             "draws_better_than_gptq")} for s in summary], indent=1))


if __name__ == "__main__":
    main()
