"""How low can W4A4 KL go by changing the experts' weights alone, and what do activation-side transforms buy? (issue 16)

Issue 16's W4A4 goal is KL <= 0.62x `amax`'s. Every method so far changes only the routed experts' NVFP4 weights,
but SGLang's W4A4 path also quantizes the experts' inputs (static per-layer input scale, NVFP4 blocks of 16). This
bench measures, on the same held-out draws as bench.quality.vs_modelopt and with validate's metrics:

- `amax` and `gptq` as validate sees them (checkpoints prepared as in bench.quality.requantize_accuracy, W4A16 and W4A4);
- the **floor**: the routed experts with their exact INT4 weights and only the served input quantization, of the
  gate/up inputs, the down inputs, or both (bench/experiments/w4a4_floor/activation_floor.py). No weight method can go below the "both" row,
  since its weight error is zero;
- two transforms a served checkpoint can carry without kernel changes (bench/experiments/w4a4_floor/activation_floor.py's docstring):
  power-of-two SmoothQuant factors folded into `post_attention_layernorm` (`--alpha`), and a 16-wide block
  Hadamard rotation of the residual stream; first with exact weights (what they do to the activation error alone),
  then with the transformed weights quantized by the BF16-source MSE block rule, against the same rule without a
  transform (what they do once the weights pay for it).

The floor and transform rows calibrate their static input scales on the calibration sequences calibrate uses
(`--samples` x `--seq-len`, calibrate's seed), once, and keep them for every draw.

    python -m bench.experiments.w4a4_floor.floor --seeds 1 2 3 4 --json bench/results/w4a4_floor_demo_cpu.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


from bench.experiments.w4a4_floor.activation_floor import (
    DOWN,
    GATE_UP,
    INPUTS,
    FloorWeights,
    InputTransform,
    TransformKind,
    WeightRule,
    calibrate_floor_scales,
)
from bench.harness.heldout import calibration_keywords, draw_spread, prepare_method
from bench.harness.provenance import demo_cpu_header
from bench.harness.heldout import (
    _runner,
    add_draw_arguments,
    draw_settings,
    figures,
    heldout_figures,
    heldout_sequences,
)

CHECKPOINT_METHODS = ("amax", "gptq")
GOAL_W4A4_RATIO = 0.62  # issue 16: KL W4A4 <= 0.62x amax
METRICS = ("kl_mean", "kl_p99", "top1")
STATS_FOLDER = "int4-aware+hessian"  # prepare_method's base for gptq: its calibration holds the expert statistics


def floor_rows(alpha: float) -> list[tuple[str, WeightRule, InputTransform, tuple[str, ...], bool]]:
    """(name, weight rule, transform, quantized inputs, also measure W4A16) for every floor / transform row."""
    none = InputTransform()
    smooth = InputTransform(TransformKind.SMOOTH_POW2, alpha=alpha)
    rotate = InputTransform(TransformKind.HADAMARD)
    return [
        ("exact weights, gate/up inputs quantized", WeightRule.EXACT, none, (GATE_UP,), False),
        ("exact weights, down inputs quantized", WeightRule.EXACT, none, (DOWN,), False),
        ("exact weights, all inputs quantized (floor)", WeightRule.EXACT, none, INPUTS, False),
        (f"exact weights + {smooth.label}", WeightRule.EXACT, smooth, INPUTS, False),
        (f"exact weights + {rotate.label}", WeightRule.EXACT, rotate, INPUTS, False),
        ("mse weights", WeightRule.MSE, none, INPUTS, True),
        (f"mse weights + {smooth.label}", WeightRule.MSE, smooth, INPUTS, True),
        (f"mse weights + {rotate.label}", WeightRule.MSE, rotate, INPUTS, True),
    ]


def _compare(weights, sequences, reference) -> dict[str, float]:
    from kimi_nvfp4.validate.metrics import TokenComparison

    comparison = TokenComparison()
    for seq, ref, test in zip(sequences, reference, _runner(weights).run(sequences)):
        comparison.add(ref, test, seq)
    return figures(comparison)


def summarize(rows: list[dict], names: list[str]) -> list[dict]:
    """Per row: mean / min / max over the draws of each measured mode's metrics, and W4A4 KL as a multiple of amax's."""
    out = []
    for name in names:
        mine = [r for r in rows if r["row"] == name]
        out.append({"row": name, "seeds": [r["seed"] for r in mine], **draw_spread(mine, METRICS)})
    amax = next(s for s in out if s["row"] == "amax")["w4a4.kl_mean"]["mean"]
    for s in out:
        s["w4a4_kl_vs_amax"] = s["w4a4.kl_mean"]["mean"] / amax
        s["meets_w4a4_goal"] = s["w4a4_kl_vs_amax"] <= GOAL_W4A4_RATIO
    return out


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_draw_arguments(ap, work_dir="/tmp/kimi_nvfp4_w4a4_floor")
    ap.add_argument("--alpha", type=float, default=0.5, help="SmoothQuant migration strength of the smooth-pow2 rows")
    ap.add_argument("--json", type=Path, default=Path("bench/results/w4a4_floor_demo_cpu.json"))
    args = ap.parse_args()

    from kimi_nvfp4.calibrate.expert_stats_file import EXPERT_STATS_DIR, read_layer_stats
    from kimi_nvfp4.calibrate.options import CalibrateOptions
    from kimi_nvfp4.checkpoint.reader import CheckpointReader
    from kimi_nvfp4.demo_model import DEMO_CHECKPOINT
    from kimi_nvfp4.model import Int4SourceWeights
    from kimi_nvfp4.stage_kit.samples import DataPart, load_sample_set

    started = time.perf_counter()
    calibration = calibration_keywords(args)
    folders, seconds = {}, {}
    for method in CHECKPOINT_METHODS:
        t0 = time.perf_counter()
        folders[method], _ = prepare_method(method, args.work_dir, args.data, calibration)
        seconds[method] = time.perf_counter() - t0
        print(json.dumps({"prepared": method, "seconds": seconds[method]}), flush=True)
    stats_dir = args.work_dir / STATS_FOLDER / "calibration" / EXPERT_STATS_DIR
    stats = {s.layer: s for s in (read_layer_stats(p) for p in sorted(stats_dir.glob("layer_*.safetensors")))}

    calib_seed = CalibrateOptions().seed
    calib = load_sample_set(folders["amax"], args.data, part=DataPart.CALIBRATION, samples=args.samples,
                            seq_len=args.seq_len, seed=calib_seed)
    specs = floor_rows(args.alpha)
    served: dict[str, FloorWeights] = {}
    weights_only: dict[str, FloorWeights] = {}
    t0 = time.perf_counter()
    for name, rule, transform, quantized, with_w4a16 in specs:
        served[name] = FloorWeights(CheckpointReader(DEMO_CHECKPOINT), rule=rule, transform=transform,
                                    quantized=quantized, stats=stats)
        calibrate_floor_scales(served[name], calib.sequences, _runner)
        if with_w4a16:
            weights_only[name] = FloorWeights(CheckpointReader(DEMO_CHECKPOINT), rule=rule, transform=transform,
                                              quantized=(), stats=stats)
    seconds["floor_calibration"] = time.perf_counter() - t0

    rows = []
    for seed in args.seeds:
        sequences = heldout_sequences(folders["amax"], args.data, samples=args.validate_samples,
                                      seq_len=args.seq_len, seed=seed)
        tokens = sum(int(s.numel()) for s in sequences)
        for name, modes in heldout_figures(folders, DEMO_CHECKPOINT, sequences).items():
            rows.append({"row": name, "seed": seed, "tokens": tokens, **modes})
            print(json.dumps(rows[-1]), flush=True)
        reference = list(_runner(Int4SourceWeights(CheckpointReader(DEMO_CHECKPOINT))).run(sequences))
        for name, *_ in specs:
            row = {"row": name, "seed": seed, "tokens": tokens, "w4a4": _compare(served[name], sequences, reference)}
            if name in weights_only:
                row["w4a16"] = _compare(weights_only[name], sequences, reference)
            rows.append(row)
            print(json.dumps(rows[-1]), flush=True)
    summary = summarize(rows, [*CHECKPOINT_METHODS, *(name for name, *_ in specs)])
    for s in summary:
        print(json.dumps(s), flush=True)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({
        **demo_cpu_header(args),
        "settings": {**draw_settings(args, seed=calib_seed, tokens=calib.tokens), "alpha": args.alpha,
                     "goal_w4a4_ratio": GOAL_W4A4_RATIO},
        "floor_input_scales": {f"{name}": {f"{layer}.{kind}": float(state.scale)
                                           for (layer, kind), state in served[name].inputs.items()}
                               for name, *_ in specs},
        "prepare_seconds": seconds, "rows": rows, "summary": summary,
        "total_seconds": time.perf_counter() - started,
    }, indent=2))


if __name__ == "__main__":
    main()
