"""Output-aware scale methods on K2.6-dimension expert matrices with synthetic heavy-tailed activations.

    python -m bench.quality.output_aware --rows 256 --json bench/results/bench_output_aware.json
    python -m bench.quality.output_aware --rows 256 --token-sweep --json bench/results/bench_output_aware_tokens.json
    python -m bench.quality.output_aware --device cuda --experts 16 --json bench/results/bench_output_aware_h200.json

Matrices: an expert's gate/up [2048, 7168] (reading the hidden state) and down [7168, 2048] (reading the
intermediate), INT4 as compressed-tensors quantizes Gaussian weights (`bench_scale_methods.synthetic_int4`);
`--rows` keeps the first rows of each (GPTQ treats rows independently, so the error ratios carry over; its
factorisation cost depends only on the input width). Activations (synthetic, as real MoE inputs: heavy-tailed,
correlated, a few outlier channels):
  hidden state   (z + f M) * c * t: z Student-t(4) noise, f M a rank-16 common part, c log-normal channel scales
                 (sigma 0.5) with 8 outlier channels x30, t a log-normal per-token scale (sigma 0.3);
  intermediate   silu(g) * u with g, u correlated Gaussians (rank-16 common part), times log-normal channel
                 scales (sigma 0.7) with 8 outlier channels x10.
Statistics come from `--calibration-tokens` rows; errors are reported in-sample (the calibration-weighted
output error tr((W-Q) H (W-Q)^T) that the methods minimise) and on `--eval-tokens` fresh rows (held-out relative
output error ||X (W-Q)^T||^2 / ||X W^T||^2), each as a ratio to int4-aware and to amax, with CPU seconds per
matrix (`--device cuda --experts N`: N experts refined together, wall seconds per expert and per 384-expert
layer, the GPU timing of the batched GPTQ, after an untimed call on one expert). `--token-sweep` measures the held-out error of gptq (dense Hessian forced; with and without the Hessian
shrinkage) and act-diag with few calibration tokens per input channel: the evidence for the fallback thresholds
in `output_aware/refine.py`.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from bench.harness.synthetic_experts import HIDDEN, MOE_INTERMEDIATE, synthetic_int4

from kimi_nvfp4.numerics.methods import (
    ExpertInputStats,
    ExpertMatrices,
    InputStatsAccumulator,
    Int4Matrix,
    output_error,
    quantize_int4_matrices,
    requantize_experts,
)
from kimi_nvfp4.numerics.methods.output_aware import refine as refine_module
from kimi_nvfp4.numerics.nvfp4 import NVFP4Tensor, dequantize_nvfp4

from bench.harness.provenance import provenance

LOW_RANK = 16
HIDDEN_OUTLIERS, HIDDEN_OUTLIER_GAIN, HIDDEN_CHANNEL_SIGMA = 8, 30.0, 0.5
INTERMEDIATE_OUTLIERS, INTERMEDIATE_OUTLIER_GAIN, INTERMEDIATE_CHANNEL_SIGMA = 8, 10.0, 0.7
TOKEN_SCALE_SIGMA = 0.3
STUDENT_T_DOF = 4.0
METHODS = ("amax", "int4-aware", "act-diag", "gptq")


class Activations:
    """A fixed synthetic distribution of one input (its channel scales and mixing drawn once); `draw(n)` gives rows."""

    def __init__(self, width: int, kind: str, seed: int):
        self.width, self.kind = width, kind
        self.gen = torch.Generator().manual_seed(seed)
        sigma, outliers, gain = (
            (HIDDEN_CHANNEL_SIGMA, HIDDEN_OUTLIERS, HIDDEN_OUTLIER_GAIN) if kind == "hidden"
            else (INTERMEDIATE_CHANNEL_SIGMA, INTERMEDIATE_OUTLIERS, INTERMEDIATE_OUTLIER_GAIN)
        )
        self.channel = torch.exp(torch.randn(width, generator=self.gen) * sigma)
        self.channel[torch.randperm(width, generator=self.gen)[:outliers]] *= gain
        self.mixing = torch.randn(LOW_RANK, width, generator=self.gen) / LOW_RANK**0.5
        self.second = torch.randn(LOW_RANK, width, generator=self.gen) / LOW_RANK**0.5
        self.t = torch.distributions.StudentT(STUDENT_T_DOF)

    def draw(self, tokens: int) -> torch.Tensor:
        common = torch.randn(tokens, LOW_RANK, generator=self.gen)
        if self.kind == "hidden":
            torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=self.gen)))
            x = self.t.sample((tokens, self.width)) + common @ self.mixing
            x = x * torch.exp(torch.randn(tokens, 1, generator=self.gen) * TOKEN_SCALE_SIGMA)
        else:
            g = torch.randn(tokens, self.width, generator=self.gen) + common @ self.mixing
            u = torch.randn(tokens, self.width, generator=self.gen) + common @ self.second
            x = torch.nn.functional.silu(g) * u
        return (x * self.channel).to(torch.bfloat16).float()  # the serving dtype


def _stats(rows: torch.Tensor, dense: bool):
    acc = InputStatsAccumulator(rows.shape[1], dense=dense)
    acc.add(rows)
    return acc.stats()


def held_out_error(m: Int4Matrix, q: NVFP4Tensor, rows: torch.Tensor) -> tuple[float, float]:
    """(||X (W - Q)^T||^2, ||X W^T||^2) on held-out rows, float64."""
    x = rows.double().to(m.device)
    w = m.values().double()
    diff = w - dequantize_nvfp4(q).double()
    return float((x @ diff.t()).square().sum()), float((x @ w.t()).square().sum())


def _clock(device: str) -> float:
    """CPU seconds of this process on the CPU (the box is shared), wall seconds after a sync on CUDA."""
    if device == "cuda":
        torch.cuda.synchronize()
        return time.perf_counter()
    return time.process_time()


def _profiled(fn, device: str, top: int = 15):
    """(fn(), the profiler's top ops by self time on `device` (CUDA) or the CPU) for `--profile`."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device == "cuda"
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        out = fn()
        if cuda:
            torch.cuda.synchronize()
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    events = sorted(prof.key_averages(), key=lambda e: getattr(e, key), reverse=True)[:top]
    ops = [{"name": e.key[:120], "count": e.count, "self_ms": getattr(e, key) / 1e3,
            "cpu_total_ms": e.cpu_time_total / 1e3} for e in events]
    return out, ops


def run_methods(experts: list[tuple[str, list[list[Int4Matrix]], Activations]], calibration: int, evaluation: int,
                methods: tuple[str, ...], device: str, profile: bool = False) -> dict:
    """`experts`: per input kind, the matrices of each expert reading it (all refined together) and the
    activation source (every expert draws its own calibration rows from it; errors use the first expert)."""
    results: dict[str, dict] = {}
    for label, per_expert, source in experts:
        calib = [source.draw(calibration) for _ in per_expert]
        held = source.draw(evaluation).to(device)
        stats = [_stats(rows.to(device), dense=True) for rows in calib]
        per_expert = [[m.to(device) for m in mats] for mats in per_expert]
        mats = per_expert[0]
        per_method = {}
        for method in methods:
            given = [ExpertMatrices(f"{label}.{e}", ms, st) for e, (ms, st) in enumerate(zip(per_expert, stats))]
            if device == "cuda":
                # untimed first call on one expert: kernel compilation and library set-up are not per-layer costs
                if method in ("amax", "int4-aware"):
                    quantize_int4_matrices(per_expert[0], method)
                else:
                    requantize_experts(method, given[:1])
            start = _clock(device)
            ops = None
            if method in ("amax", "int4-aware"):
                outputs = [quantize_int4_matrices(ms, method) for ms in per_expert]
                tensors, note = outputs[0], {}
            else:
                if profile:  # timed with the profiler's overhead: the seconds are then not the plain figure
                    summary, ops = _profiled(lambda: requantize_experts(method, given), device)
                else:
                    summary = requantize_experts(method, given)
                expert = summary.experts[0]
                tensors, note = expert.tensors, {"statistics": summary.counts(), "kept_int4_aware": expert.kept_search}
            seconds = _clock(device) - start
            rows = []
            for m, q in zip(mats, tensors):
                error, norm = held_out_error(m, q, held)
                rows.append({
                    "shape": list(m.shape),
                    "weighted_error_dense": float(output_error(m, q, stats[0])),
                    "weighted_error_diagonal": float(output_error(m, q, stats[0].diagonal())),
                    "held_out_error": error,
                    "held_out_norm": norm,
                })
            matrices = sum(len(ms) for ms in per_expert)
            per_method[method] = {
                "matrices": rows, "seconds": seconds, "seconds_per_matrix": seconds / matrices,
                "seconds_per_384_expert_layer": seconds / len(per_expert) * 384, **note,
            }
            if ops is not None:
                per_method[method]["profile_top_ops"] = ops
        results[label] = per_method
    return results


def summarise(results: dict, methods: tuple[str, ...]) -> dict:
    """Pooled over matrices per expert input kind: errors, ratios to int4-aware and amax, seconds per matrix."""
    out = {}
    for label, per_method in results.items():
        pooled = {}
        for method in methods:
            rows = per_method[method]["matrices"]
            pooled[method] = {
                "weighted_error_dense": sum(r["weighted_error_dense"] for r in rows),
                "weighted_error_diagonal": sum(r["weighted_error_diagonal"] for r in rows),
                "held_out_relative_error": sum(r["held_out_error"] for r in rows) / sum(r["held_out_norm"] for r in rows),
                "seconds_per_matrix": per_method[method]["seconds_per_matrix"],
            }
        for method in methods:
            for base in ("int4-aware", "amax"):
                for key in ("weighted_error_dense", "weighted_error_diagonal", "held_out_relative_error"):
                    pooled[method][f"{key}_vs_{base}"] = pooled[method][key] / pooled[base][key]
        out[label] = pooled
    return out


def _unshrunk(stats: ExpertInputStats) -> ExpertInputStats:
    """The same statistics without their fourth moments: GPTQ then takes H as it is (no shrinkage)."""
    return ExpertInputStats(stats.tokens, stats.channel_energy, stats.hessian)


def token_sweep(rows: int, seed: int, evaluation: int, fractions: list[float]) -> list[dict]:
    """Held-out error ratio to int4-aware of gptq (dense forced) and act-diag vs calibration tokens per channel."""
    out = []
    gen = torch.Generator().manual_seed(seed)
    for label, width, kind, out_rows in (("gate", HIDDEN, "hidden", min(rows, MOE_INTERMEDIATE)),
                                         ("down", MOE_INTERMEDIATE, "intermediate", min(rows, HIDDEN))):
        m = synthetic_int4(out_rows, width, gen, "cpu")
        source = Activations(width, kind, seed + 7)
        held = source.draw(evaluation)
        (base,) = quantize_int4_matrices([m], "int4-aware")
        base_error, _ = held_out_error(m, base, held)
        for fraction in fractions:
            tokens = max(2, int(fraction * width))
            stats = _stats(source.draw(tokens), dense=True)
            row = {"matrix": label, "shape": list(m.shape), "tokens": tokens, "tokens_per_channel": tokens / width}
            saved = refine_module.DENSE_MIN_TOKENS_PER_CHANNEL, refine_module.DIAGONAL_MIN_TOKENS
            refine_module.DENSE_MIN_TOKENS_PER_CHANNEL, refine_module.DIAGONAL_MIN_TOKENS = 0.0, 0
            row["hessian_shrinkage"] = stats.hessian_shrinkage()
            try:
                for label_method, method, given in (("act-diag", "act-diag", stats), ("gptq", "gptq", stats),
                                                    ("gptq-unshrunk", "gptq", _unshrunk(stats))):
                    expert = requantize_experts(method, [ExpertMatrices(label, [m], given)]).experts[0]
                    error, _ = held_out_error(m, expert.tensors[0], held)
                    row[f"{label_method}_held_out_vs_int4_aware"] = error / base_error
                    row[f"{label_method}_in_sample_vs_int4_aware"] = expert.final_error[0] / expert.search_error[0]
            finally:
                refine_module.DENSE_MIN_TOKENS_PER_CHANNEL, refine_module.DIAGONAL_MIN_TOKENS = saved
            print(json.dumps(row), flush=True)
            out.append(row)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=None, help="keep the first ROWS output rows of each matrix")
    parser.add_argument("--calibration-tokens", type=int, default=8192)
    parser.add_argument("--eval-tokens", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--experts", type=int, default=1, help="experts per input kind, refined together")
    parser.add_argument("--methods", nargs="*", default=list(METHODS))
    parser.add_argument("--token-sweep", action="store_true", help="only the calibration-token sweep")
    parser.add_argument("--fractions", type=float, nargs="*", default=[0.03, 0.125, 0.25, 0.5, 1.0, 2.0])
    parser.add_argument("--profile", action="store_true",
                        help="torch.profiler's top ops of each output-aware method's call (slows the timed call)")
    parser.add_argument("--json", default=None, help="write the results here (bench/results/...)")
    args = parser.parse_args(argv)
    record = {
        **provenance(None if argv is None else [__file__, *argv], device=args.device),
        "threads": torch.get_num_threads(),
    }
    if args.token_sweep:
        record["token_sweep"] = token_sweep(args.rows or HIDDEN, args.seed, args.eval_tokens, args.fractions)
    else:
        gen = torch.Generator().manual_seed(args.seed)
        up_rows = min(args.rows or MOE_INTERMEDIATE, MOE_INTERMEDIATE)
        down_rows = min(args.rows or HIDDEN, HIDDEN)
        gate_up = [[synthetic_int4(up_rows, HIDDEN, gen, "cpu") for _ in range(2)] for _ in range(args.experts)]
        down = [[synthetic_int4(down_rows, MOE_INTERMEDIATE, gen, "cpu")] for _ in range(args.experts)]
        experts = [
            ("gate_up", gate_up, Activations(HIDDEN, "hidden", args.seed + 1)),
            ("down", down, Activations(MOE_INTERMEDIATE, "intermediate", args.seed + 2)),
        ]
        methods = tuple(args.methods)
        record["results"] = run_methods(experts, args.calibration_tokens, args.eval_tokens, methods, args.device,
                                        args.profile)
        record["summary"] = summarise(record["results"], methods)
        print(json.dumps(record["summary"], indent=1))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
