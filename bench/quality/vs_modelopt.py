"""Our scale methods against Model Optimizer 0.47's own NVFP4 recipes, one run, same model, same data (issue 16).

Reference: the INT4 demo model (`Int4SourceWeights`). Rows:
- ours (`--methods`): convert -> calibrate [-> requantize] exactly as bench.quality.requantize_accuracy
  (`prepare_method`, imported);
- Model Optimizer (`--recipes`): the INT4 model dequantized exactly into transformers' DeepseekV3 (fused 3-D
  experts, which Model Optimizer's `_QuantFusedExperts` plugin quantizes per expert with one shared input
  quantizer per layer for gate/up and one for down; bench/harness/modelopt_cpu/hf_model.py), each recipe restricted to
  the routed experts and calibrated by `mtq.quantize` with a forward loop over the calibration sequences our
  calibrate uses (same data, `--samples`, `--seq-len`, calibrate's default seed), its NVFP4 CPU kernels replaced
  by bit-exact pure-torch twins (bench/harness/modelopt_cpu/patch.py says what is patched), exported by Model
  Optimizer's fused-experts exporter into a copy of the `amax` checkpoint (bench/harness/modelopt_cpu/recipes.py).
Every row is then measured the same way on the same held-out draws (`--seeds`): validate's KL mean / p99, top-1
and perplexity ratio, W4A16 and W4A4 (SGLang's per-layer max input scales), bench/harness/heldout.py. A recipe that
fails is recorded with its error, not dropped silently; one whose exported weights are byte-identical to another
recipe's is flagged (`weights_identical_to`: in 0.47 AWQ-lite does not visit fused experts, so it equals the
default recipe). Defaults: the issue's 64 x 256 = 16k held-out tokens per draw, four draws; on the shared 2-core
CPU the committed run uses 16 x 256 (bench.quality.requantize_accuracy's settings).

    python -m bench.quality.vs_modelopt --seeds 1 2 3 4 \\
        --json bench/results/accuracy_vs_modelopt_demo_cpu.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
import traceback
from pathlib import Path

import torch


from bench.harness.heldout import calibration_keywords, draw_spread, prepare_method
from bench.harness.heldout import MODES, add_draw_arguments, draw_settings, heldout_figures, heldout_sequences
from bench.harness.provenance import demo_cpu_header

METRICS = ("kl_mean", "kl_p99", "top1", "ppl_ratio")
OUR_METHODS = ("amax", "int4-aware", "act-diag", "gptq", "gptq-w4a4")
BASE_METHOD = "amax"  # the checkpoint Model Optimizer's expert tensors are written into (all else identical)
GOAL_KL_RATIO = 0.8  # issue 16: KL <= 0.8x the best Model Optimizer recipe
MODELOPT_PREFIX = "modelopt:"
EXPERT_SUFFIX = ".mlp.experts.0.gate_proj.weight"
WEIGHT_TENSORS = ("weight", "weight_scale", "weight_scale_2")


def _expert_name_format(folder: Path) -> str:
    """`{layer}, {expert}, {projection}` -> the checkpoint's routed-expert module name."""
    from kimi_nvfp4.checkpoint.reader import CheckpointReader

    with CheckpointReader(folder) as reader:
        name = next(n for n in reader.tensors if n.endswith(EXPERT_SUFFIX))
    prefix = name[: name.index(".layers.")]
    return prefix + ".layers.{0}.mlp.experts.{1}.{2}"


def _digest(exported: dict, keys: tuple[str, ...]) -> str:
    """sha256 over the exported tensors named `keys`, in (layer, expert, projection) order."""
    h = hashlib.sha256()
    for key in sorted(exported):
        for k in keys:
            if k in exported[key]:
                h.update(exported[key][k].contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _flag_identical(records: dict) -> None:
    """A recipe whose exported weights are byte-identical to another's did not change them (e.g. its algorithm
    never reached the fused experts): say so next to its row."""
    seen: dict[str, str] = {}
    for recipe, r in records.items():
        digest = r.get("weights_sha256")
        if digest is None:
            continue
        if digest in seen:
            r["weights_identical_to"] = seen[digest]
        else:
            seen[digest] = recipe


def prepare_modelopt(recipes, base: Path, work_dir: Path, calibration_sequences) -> tuple[dict, dict]:
    from bench.harness.modelopt_cpu.hf_model import load_deepseek_v3
    from bench.harness.modelopt_cpu.recipes import export_experts, quantize_experts, write_checkpoint
    from kimi_nvfp4.demo_model import DEMO_CHECKPOINT

    folders, records = {}, {}
    expert_name = _expert_name_format(base)
    for recipe in recipes:
        t0 = time.perf_counter()
        try:
            model = quantize_experts(load_deepseek_v3(DEMO_CHECKPOINT), recipe, calibration_sequences)
            exported = export_experts(model)
            written = write_checkpoint(base, work_dir / f"modelopt-{recipe}", exported, expert_name)
            records[recipe] = {"seconds": time.perf_counter() - t0, **written,
                               "weights_sha256": _digest(exported, WEIGHT_TENSORS),
                               "input_scales_sha256": _digest(exported, ("input_scale",))}
            folders[MODELOPT_PREFIX + recipe] = work_dir / f"modelopt-{recipe}"
        except Exception as e:  # recorded in the result file, the other rows still run
            records[recipe] = {"seconds": time.perf_counter() - t0, "error": f"{type(e).__name__}: {e}",
                               "traceback": traceback.format_exc(limit=-6)}
        print(json.dumps({"recipe": recipe} | {k: v for k, v in records[recipe].items() if k != "traceback"}),
              flush=True)
    _flag_identical(records)
    return folders, records


def summarize(rows: list[dict], names: list[str]) -> list[dict]:
    out = []
    for name in names:
        mine = [r for r in rows if r["row"] == name]
        out.append({"row": name, "seeds": [r["seed"] for r in mine], **draw_spread(mine, METRICS)})
    modelopt = [s for s in out if s["row"].startswith(MODELOPT_PREFIX)]
    for mode in MODES:
        for metric in ("kl_mean", "kl_p99"):
            key = f"{mode}.{metric}"
            if not modelopt:
                continue
            best = min(modelopt, key=lambda s: s[key]["mean"])
            for s in out:
                s.setdefault("ratio_to_best_modelopt", {})[key] = {
                    "ratio": s[key]["mean"] / best[key]["mean"], "best": best["row"]}
    for s in out:
        if not s["row"].startswith(MODELOPT_PREFIX) and "ratio_to_best_modelopt" in s:
            s["goal_kl_met"] = all(s["ratio_to_best_modelopt"][f"{m}.kl_mean"]["ratio"] <= GOAL_KL_RATIO for m in MODES)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_draw_arguments(ap, work_dir="/tmp/kimi_nvfp4_vs_modelopt", validate_samples=64)
    ap.add_argument("--methods", nargs="+", default=list(OUR_METHODS))
    ap.add_argument("--recipes", nargs="+", default=None, help="Model Optimizer configs (default: all five)")
    ap.add_argument("--ours-only", action="store_true",
                    help="no Model Optimizer rows (its recipes take most of the run): our methods on the same draws")
    ap.add_argument("--json", type=Path, default=Path("bench/results/accuracy_vs_modelopt_demo_cpu.json"))
    args = ap.parse_args()

    from bench.harness.modelopt_cpu.recipes import RECIPES
    from kimi_nvfp4.calibrate.options import CalibrateOptions
    from kimi_nvfp4.demo_model import DEMO_CHECKPOINT
    from kimi_nvfp4.stage_kit.samples import DataPart, load_sample_set

    args.recipes = [] if args.ours_only else args.recipes or list(RECIPES)
    methods = list(dict.fromkeys([BASE_METHOD, *args.methods]))
    started = time.perf_counter()
    calibration = calibration_keywords(args)
    folders, seconds, stats = {}, {}, {}

    def prepare(method: str) -> None:
        t0 = time.perf_counter()
        folders[method], stats[method] = prepare_method(method, args.work_dir, args.data, calibration)
        seconds[method] = time.perf_counter() - t0
        print(json.dumps({"method": method, "seconds": seconds[method]}), flush=True)

    prepare(BASE_METHOD)  # Model Optimizer's rows are written into a copy of it: first
    calib_seed = CalibrateOptions().seed
    calib = load_sample_set(folders[BASE_METHOD], args.data, part=DataPart.CALIBRATION, samples=args.samples,
                            seq_len=args.seq_len, seed=calib_seed)
    mo_folders, mo_records = prepare_modelopt(args.recipes, folders[BASE_METHOD], args.work_dir, calib.sequences)
    for method in methods[1:]:
        prepare(method)
    everything = {name: folders[name] for name in methods if name in args.methods} | mo_folders

    rows = []
    for seed in args.seeds:
        sequences = heldout_sequences(folders[BASE_METHOD], args.data, samples=args.validate_samples,
                                      seq_len=args.seq_len, seed=seed)
        tokens = sum(int(s.numel()) for s in sequences)
        for name, modes in heldout_figures(everything, DEMO_CHECKPOINT, sequences).items():
            rows.append({"row": name, "seed": seed, "tokens": tokens, **modes})
            print(json.dumps(rows[-1]), flush=True)
    summary = summarize(rows, list(everything))
    for s in summary:
        print(json.dumps(s), flush=True)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({
        **demo_cpu_header(args),
        "settings": {**draw_settings(args, seed=calib_seed, tokens=calib.tokens), "goal_kl_ratio": GOAL_KL_RATIO},
        "prepare_seconds": seconds, "statistics": {k: v for k, v in stats.items() if v is not None},
        "modelopt": mo_records, "rows": rows, "summary": summary,
        "total_seconds": time.perf_counter() - started,
    }, indent=2))


if __name__ == "__main__":
    main()
