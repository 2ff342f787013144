"""Benchmark NVFP4 scale-selection methods on synthetic Kimi K2.6-shaped INT4 experts.

Synthetic experts: gate/up [2048, 7168], down [7168, 2048]; weights ~ N(0, 1) times a per-row
log-normal spread (sigma 0.3), quantized per group of 32 as compressed-tensors does for symmetric
int4: scale = absmax / 7.5 rounded to bf16, code = clamp(round(w / scale), -8, 7). So codes are
roughly Gaussian with +-7/-8 at each group's maximum, as in a round-to-nearest INT4 checkpoint.

Reports per method: relative MSE against the exact INT4 values (sum sq. error / sum sq.), ratio to
`amax`, fraction of values reproduced exactly, the worst tensor, and conversion speed (params/s).
Also Model Optimizer itself on the BF16-dequantized weights: NVFP4QTensor default, and its
NVFP4_FOUR_OVER_SIX_CFG and NVFP4_W4A4_WEIGHT_MSE_FP8_SWEEP_CFG calibrations when they run on this
device (they need Triton, so CUDA only).

    python -m bench.quality.scale_methods --device cpu --experts 1 --rows 256
    python -m bench.quality.scale_methods --checkpoint demo --experts 1000
    python -m bench.quality.scale_methods --device cuda --experts 8 --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field

import torch

from kimi_nvfp4.numerics.methods import (
    Int4Matrix,
    MatrixErrorStats,
    ScaleMethod,
    error_stats,
    quantize_int4_matrices,
    weight_only_methods,
)
from kimi_nvfp4.numerics.nvfp4 import NVFP4Tensor

from bench.harness.synthetic_experts import synthetic_experts, synthetic_int4

from bench.harness.provenance import provenance

def checkpoint_experts(path: str, limit: int | None, device: str) -> list[tuple[str, dict[str, Int4Matrix]]]:
    """Routed INT4 experts of a real checkpoint (`demo` = the bundled tiny K2), in name order."""
    from kimi_nvfp4.checkpoint.layout import parse_expert_name
    from kimi_nvfp4.checkpoint.reader import CheckpointReader

    if path == "demo":
        from kimi_nvfp4.demo_model import DEMO_CHECKPOINT

        path = str(DEMO_CHECKPOINT)
    reader = CheckpointReader(path)
    modules: dict[tuple[int, int], dict[str, str]] = {}
    for name in reader.tensors:
        parsed = parse_expert_name(name)
        if parsed is not None and parsed.suffix == "weight_packed":
            modules.setdefault((parsed.layer, parsed.expert), {})[parsed.proj] = parsed.module
    experts = []
    for (layer, expert), projs in sorted(modules.items())[:limit]:
        mats = {}
        for proj, module in projs.items():
            shape = reader.load(f"{module}.weight_shape").tolist()
            mats[proj] = Int4Matrix.from_packed(
                reader.load(f"{module}.weight_packed"), reader.load(f"{module}.weight_scale"), int(shape[1])
            ).to(device)
        experts.append((f"layers.{layer}.experts.{expert}", mats))
    return experts


@dataclass
class Row:
    method: str
    stats: list[tuple[str, MatrixErrorStats]] = field(default_factory=list)
    seconds: float = 0.0
    note: str = ""

    def summary(self, amax_rel: float | None) -> dict:
        pooled = MatrixErrorStats.pooled([s for _, s in self.stats])
        worst_name, worst = max(self.stats, key=lambda kv: kv[1].rel_mse)
        return {
            "method": self.method,
            "rel_mse": pooled.rel_mse,
            "ratio_to_amax": pooled.rel_mse / amax_rel if amax_rel else 1.0,
            "exact_fraction": pooled.exact_fraction,
            "worst_tensor": worst_name,
            "worst_rel_mse": worst.rel_mse,
            "params_per_s": pooled.numel / self.seconds if self.seconds else float("nan"),
            "note": self.note,
        }


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def run_method(experts, method: ScaleMethod, device: str) -> Row:
    row = Row(method.value)
    for label, mats in experts:
        for names in _groups(mats):
            _sync(device)
            start = time.perf_counter()
            out = quantize_int4_matrices([mats[n] for n in names], method)
            _sync(device)
            row.seconds += time.perf_counter() - start
            for n, q in zip(names, out):
                row.stats.append((f"{label}.{n}", error_stats(mats[n], q)))
    return row


def _groups(mats: dict[str, Int4Matrix]) -> list[tuple[str, ...]]:
    """gate and up share weight_scale_2 (SGLang keeps w1's for w13); down alone."""
    shared = tuple(n for n in ("gate_proj", "up_proj") if n in mats)
    return [g for g in (shared, ("down_proj",) if "down_proj" in mats else ()) if g]


def _as_nvfp4(packed, scale, scale_2) -> NVFP4Tensor:
    return NVFP4Tensor(packed._quantized_data, scale, scale_2.float().reshape(()))


def run_modelopt_default(experts, device: str) -> Row:
    """NVFP4QTensor.quantize on the BF16 dequantized weights (gate/up share weights_scaling_factor_2)."""
    from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor

    row = Row("modelopt NVFP4QTensor (bf16)")
    for label, mats in experts:
        for names in _groups(mats):
            bf16 = {n: mats[n].values().to(torch.bfloat16) for n in names}
            _sync(device)
            start = time.perf_counter()
            shared = torch.stack([bf16[n].abs().amax().float() for n in names]).amax() / (6 * 448)
            results = {n: NVFP4QTensor.quantize(bf16[n], 16, weights_scaling_factor_2=shared) for n in names}
            _sync(device)
            row.seconds += time.perf_counter() - start
            for n in names:
                row.stats.append((f"{label}.{n}", error_stats(mats[n], _as_nvfp4(*results[n]))))
    return row


MODELOPT_CONFIGS = {
    "modelopt-four-over-six": "NVFP4_FOUR_OVER_SIX_CFG",
    "modelopt-sweep": "NVFP4_W4A4_WEIGHT_MSE_FP8_SWEEP_CFG",
}


def run_modelopt_config(experts, device: str, key: str) -> Row:
    """A Model Optimizer PTQ config's weight quantization of a BF16 nn.Linear, exported as NVFP4QTensor does."""
    import modelopt.torch.quantization as mtq
    from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor

    cfg_name = MODELOPT_CONFIGS[key]
    cfg = getattr(mtq, cfg_name, None)
    if cfg is None:
        raise RuntimeError(f"this nvidia-modelopt has no {cfg_name}")
    row = Row(f"modelopt {cfg_name} (bf16)")
    for label, mats in experts:
        for n, m in mats.items():
            layer = torch.nn.Linear(m.shape[1], m.shape[0], bias=False, dtype=torch.bfloat16, device=device)
            with torch.no_grad():
                layer.weight.copy_(m.values().to(torch.bfloat16))
            model = torch.nn.Sequential(layer)
            x = torch.randn(4, m.shape[1], dtype=torch.bfloat16, device=device)
            _sync(device)
            start = time.perf_counter()
            mtq.quantize(model, cfg, forward_loop=lambda mod, x=x: mod(x))
            quantizer = model[0].weight_quantizer
            scale, scale_2 = NVFP4QTensor.get_weights_scaling_factor_from_quantizer(quantizer, model[0].weight)
            packed, scale, scale_2 = NVFP4QTensor.quantize(
                model[0].weight, 16, weights_scaling_factor=scale, weights_scaling_factor_2=scale_2
            )
            _sync(device)
            row.seconds += time.perf_counter() - start
            row.stats.append((f"{label}.{n}", error_stats(m, _as_nvfp4(packed, scale, scale_2))))
    row.note = "per matrix (no shared gate/up scale)"
    return row


def warm_up(device: str) -> None:
    """First CUDA calls pay for context and kernel loading; keep that out of the timings."""
    if device != "cuda":
        return
    gen = torch.Generator().manual_seed(1)
    small = synthetic_int4(64, 256, gen, device)
    for method in weight_only_methods():
        quantize_int4_matrices([small], method)
    _sync(device)


def format_table(rows: list[dict]) -> str:
    header = "| method | rel MSE | × amax | exact codes | worst tensor (rel MSE) | Mparams/s |"
    lines = [header, "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['method']} | {r['rel_mse']:.5f} | {r['ratio_to_amax']:.3f} | {r['exact_fraction']:.4f} | "
            f"{r['worst_tensor']} ({r['worst_rel_mse']:.5f}) | {r['params_per_s'] / 1e6:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--experts", type=int, default=1, help="experts to convert (3 matrices each)")
    parser.add_argument(
        "--checkpoint", default=None, help="INT4 checkpoint to read experts from ('demo' = bundled tiny K2) instead of synthetic"
    )
    parser.add_argument("--rows", type=int, default=None, help="keep only the first ROWS output rows (faster)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip", nargs="*", default=[], help="methods to skip: amax int4-aware sweep modelopt modelopt-four-over-six modelopt-sweep")
    parser.add_argument("--json", default=None, help="also write the results as JSON here")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda but no CUDA device", file=sys.stderr)
        return 5
    if args.checkpoint:
        experts = checkpoint_experts(args.checkpoint, args.experts, args.device)
    else:
        experts = synthetic_experts(args.experts, args.rows, args.seed, args.device)
    warm_up(args.device)
    rows: list[Row] = []
    for method in weight_only_methods():
        if method.value not in args.skip:
            rows.append(run_method(experts, method, args.device))
    if "modelopt" not in args.skip:
        rows.append(run_modelopt_default(experts, args.device))
    for key in MODELOPT_CONFIGS:
        if key in args.skip:
            continue
        try:
            rows.append(run_modelopt_config(experts, args.device, key))
        except (RuntimeError, ImportError, NotImplementedError, AssertionError) as exc:  # e.g. no Triton on CPU
            print(f"{key} not measured: {type(exc).__name__}: {exc}", file=sys.stderr)
    amax_rel = next((MatrixErrorStats.pooled([s for _, s in r.stats]).rel_mse for r in rows if r.method == "amax"), None)
    summaries = [r.summary(amax_rel) for r in rows]
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    source = args.checkpoint or f"synthetic K2.6 (rows {args.rows or 'full'})"
    print(f"device {device_name}, {len(experts)} expert(s) of {source}, torch {torch.__version__}")
    print(format_table(summaries))
    if args.json:
        with open(args.json, "w") as f:
            record = {"device": device_name, "source": source, "experts": len(experts), "rows": args.rows,
                      "results": summaries, **provenance()}
            json.dump(record, f, indent=2)
            f.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
