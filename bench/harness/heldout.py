"""validate's end-to-end figures (KL mean / p99, top-1, perplexity ratio) for many checkpoints on one held-out draw,
running the INT4 reference once.

Same pieces as `validate_checkpoint`'s end-to-end part: the held-out sequences of `load_sample_set(...,
DataPart.HELDOUT, seed)`, the layer-streamed reference model with validate's runner settings (`_runner_kwargs`),
`NVFP4Weights` in W4A16 / W4A4 with validate's default input-scale reduction (SGLang's per-layer max), and
`TokenComparison` (validate/metrics.py). What it skips is validate's per-layer and weight checks and its gates,
and the INT4 stream is computed once per draw instead of once per checkpoint (the bench compares nine).
"""

from __future__ import annotations

import shutil
import statistics
from collections.abc import Mapping
from pathlib import Path

import torch

from kimi_nvfp4.checkpoint.reader import CheckpointReader
from kimi_nvfp4.model import Int4SourceWeights, LayerStreamRunner, NVFP4Weights
from kimi_nvfp4.stage_kit.samples import DataPart, load_sample_set
from kimi_nvfp4.validate.streams import _runner_kwargs
from kimi_nvfp4.validate.metrics import TokenComparison
from kimi_nvfp4.validate.options import ValidateOptions

MODES = ("w4a16", "w4a4")
DEVICE = torch.device("cpu")
DTYPE = torch.float32
METRICS = ("kl_mean", "kl_p99", "top1")


def draw_spread(rows: list[dict], metrics: tuple[str, ...] = METRICS) -> dict:
    """`{"<mode>.<metric>": {"mean", "min", "max"}}` over the held-out draws in `rows` (one row per draw); a mode
    no row measured is left out."""
    out = {}
    for mode in MODES:
        for metric in metrics:
            values = [r[mode][metric] for r in rows if mode in r]
            if values:
                out[f"{mode}.{metric}"] = {"mean": statistics.fmean(values), "min": min(values), "max": max(values)}
    return out


def prepare_method(method: str, work_dir: Path, data: str, calibration: dict) -> tuple[Path, dict | None]:
    """The demo checkpoint converted with `method` and calibrated (`calibration`: calibrate_checkpoint's
    keywords); act-diag / gptq / gptq-w4a4: the int4-aware conversion calibrated with the statistics the method
    needs (hessian; w4a4 for gptq-w4a4; made once per kind under `work_dir`), then requantized. Returns the folder and, for requantized methods, which
    statistics were used."""
    from kimi_nvfp4.calibrate import calibrate_checkpoint
    from kimi_nvfp4.checkpoint.manifest import load_manifest
    from kimi_nvfp4.convert import convert_checkpoint
    from kimi_nvfp4.demo_model import DEMO_CHECKPOINT
    from kimi_nvfp4.requantize import expert_stats_mode_for, requantize_checkpoint

    out = work_dir / method
    shutil.rmtree(out, ignore_errors=True)
    if method in ("amax", "int4-aware"):
        convert_checkpoint(DEMO_CHECKPOINT, out, device="cpu", progress=False, method=method)
        calibrate_checkpoint(out, DEMO_CHECKPOINT, data, **calibration)
        return out, None
    # act-diag takes the hessian statistics too (their diagonal): one base serves it and gptq
    mode = "hessian" if method == "act-diag" else expert_stats_mode_for(method).value
    base = work_dir / f"int4-aware+{mode}"
    if not base.exists():
        convert_checkpoint(DEMO_CHECKPOINT, base, device="cpu", progress=False)
        calibrate_checkpoint(base, DEMO_CHECKPOINT, data, expert_stats=mode, **calibration)
    shutil.copytree(base, out)
    requantize_checkpoint(out, DEMO_CHECKPOINT, method=method, device="cpu", progress=False)
    manifest = load_manifest(out)
    record = manifest.stages["requantize"].outputs
    return out, {"calibration": manifest.stages["calibrate"].outputs["expert_stats"] | {"files": None},
                 "requantize": {s: sum(e["sources"].get(s, 0) for e in record["shards"].values())
                                for s in ("expert-dense", "expert-diagonal", "shared-dense",
                                          "shared-diagonal", "none")}
                 | {"matrices_kept_search": sum(e["matrices_kept_search"] for e in record["shards"].values())}}




def add_draw_arguments(parser, *, work_dir: str, samples: int = 16, validate_samples: int = 16,
                       seeds: tuple[int, ...] = (1, 2, 3, 4)) -> None:
    """The options every demo-model accuracy bench shares, in one order (it is the order of their recorded
    commands): the work folder, the data, calibration and held-out sizes, the held-out draws."""
    parser.add_argument("--work-dir", type=Path, default=Path(work_dir))
    parser.add_argument("--data", default="builtin")
    parser.add_argument("--samples", type=int, default=samples, help="calibration sequences")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--min-expert-tokens", type=int, default=64)
    parser.add_argument("--validate-samples", type=int, default=validate_samples, help="held-out sequences per draw")
    parser.add_argument("--seeds", type=int, nargs="+", default=list(seeds), help="held-out draws")


def calibration_keywords(args) -> dict:
    """`calibrate_checkpoint`'s keywords for `add_draw_arguments`' calibration sizes, on the CPU, quietly (every demo
    accuracy bench calibrates this way)."""
    return dict(samples=args.samples, seq_len=args.seq_len, min_expert_tokens=args.min_expert_tokens, device="cpu",
                progress=False)


def draw_settings(args, **calibration) -> dict:
    """What a result file records of `add_draw_arguments`' options: the calibration sizes (with `calibration`'s
    extra figures, e.g. its seed and token count) and the held-out draws."""
    return {"calibration": {"samples": args.samples, "seq_len": args.seq_len, **calibration},
            "heldout": {"samples": args.validate_samples, "seq_len": args.seq_len, "seeds": args.seeds}}


def _runner(source) -> LayerStreamRunner:
    # materialize False: the runner's default (on the CPU "auto" decides the same: per chunk)
    return LayerStreamRunner(source, **_runner_kwargs(DEVICE, None, None, DTYPE, False, False))


def figures(c: TokenComparison) -> dict[str, float]:
    return {"kl_mean": c.kl_mean, "kl_p99": c.kl_p99, "top1": c.top1, "ppl_ratio": c.ppl_ratio}


def heldout_sequences(checkpoint: Path, data: str, *, samples: int, seq_len: int, seed: int) -> list[torch.Tensor]:
    """validate's held-out draw `seed` (generating it is most of a draw's CPU time: made once, used for every row)."""
    return load_sample_set(checkpoint, data, part=DataPart.HELDOUT, samples=samples, seq_len=seq_len,
                           seed=seed).sequences


@torch.no_grad()
def heldout_figures(checkpoints: Mapping[str, Path], source: Path,
                    sequences: list[torch.Tensor]) -> dict[str, dict[str, dict[str, float]]]:
    """{name: {mode: figures}} for every checkpoint on the same held-out sequences."""
    reduction = ValidateOptions().input_scale_reduction.value
    reference = list(_runner(Int4SourceWeights(CheckpointReader(source))).run(sequences))
    out: dict[str, dict[str, dict[str, float]]] = {}
    for name, folder in checkpoints.items():
        out[name] = {}
        for mode in MODES:
            weights = NVFP4Weights(CheckpointReader(folder), activations=mode, input_scale_reduction=reduction)
            comparison = TokenComparison()
            for seq, ref, test in zip(sequences, reference, _runner(weights).run(sequences)):
                comparison.add(ref, test, seq)
            out[name][mode] = figures(comparison)
    return out
