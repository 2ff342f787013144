"""validate's end-to-end figures (KL mean / p99, top-1, perplexity ratio) for many checkpoints on one held-out draw,
running the INT4 reference once.

Same pieces as `validate_checkpoint`'s end-to-end part: the held-out sequences of `load_sample_set(...,
DataPart.HELDOUT, seed)`, the layer-streamed reference model with validate's runner settings (`_runner_kwargs`),
`NVFP4Weights` in W4A16 / W4A4 with validate's default input-scale reduction (SGLang's per-layer max), and
`TokenComparison` (validate/metrics.py). What it skips is validate's per-layer and weight checks and its gates,
and the INT4 stream is computed once per draw instead of once per checkpoint (the bench compares nine).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from kimi_nvfp4.checkpoint.reader import CheckpointReader
from kimi_nvfp4.model import Int4SourceWeights, LayerStreamRunner, NVFP4Weights
from kimi_nvfp4.stage_kit.samples import DataPart, load_sample_set
from kimi_nvfp4.validate.api import _runner_kwargs
from kimi_nvfp4.validate.metrics import TokenComparison
from kimi_nvfp4.validate.options import ValidateOptions

MODES = ("w4a16", "w4a4")
DEVICE = torch.device("cpu")
DTYPE = torch.float32


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


def draw_settings(args, **calibration) -> dict:
    """What a result file records of `add_draw_arguments`' options: the calibration sizes (with `calibration`'s
    extra figures, e.g. its seed and token count) and the held-out draws."""
    return {"calibration": {"samples": args.samples, "seq_len": args.seq_len, **calibration},
            "heldout": {"samples": args.validate_samples, "seq_len": args.seq_len, "seeds": args.seeds}}


def _runner(source) -> LayerStreamRunner:
    return LayerStreamRunner(source, **_runner_kwargs(DEVICE, None, None, DTYPE, False))


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
