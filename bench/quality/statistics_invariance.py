"""How far the output-aware path is from bit-identical across cuts of the work: the demo calibrated with expert
statistics (`--expert-stats hessian`) at the default MLP/MoE chunk and at an uneven one, then requantized with
`gptq` from each.

Input scales and activations are batch-invariant (model/batch_invariant.py), but an expert's statistics are sums
over its tokens (X^T X), and a GEMM's reduction over tokens is grouped by chunk: the same terms in other groups.
This measures by how much the statistics differ and how many bytes of the requantized expert shards it changes.

    python -m bench.quality.statistics_invariance --json bench/results/statistics_invariance_demo_cpu.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open

from bench.harness.provenance import provenance
from kimi_nvfp4.calibrate.api import calibrate_checkpoint
from kimi_nvfp4.calibrate.expert_stats_file import EXPERT_STATS_DIR
from kimi_nvfp4.convert.api import convert_checkpoint
from kimi_nvfp4.demo_model import DEMO_CHECKPOINT
from kimi_nvfp4.requantize.api import requantize_checkpoint


def _tensors(folder: Path, pattern: str) -> dict[str, torch.Tensor]:
    out = {}
    for path in sorted(folder.glob(pattern)):
        with safe_open(path, "pt") as f:
            for key in f.keys():
                out[f"{path.name}:{key}"] = f.get_tensor(key)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--other-chunk", type=int, default=997)
    ap.add_argument("--json", type=Path, required=True)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        base = root / "nvfp4"
        convert_checkpoint(DEMO_CHECKPOINT, base, device="cpu", progress=False, record_stats=False)
        outs = {}
        for chunk in (None, args.other_chunk):
            out = root / f"chunk_{chunk}"
            shutil.copytree(base, out)
            calibrate_checkpoint(out, DEMO_CHECKPOINT, "builtin", samples=args.samples, seq_len=args.seq_len,
                                 device="cpu", progress=False, expert_stats="hessian", max_chunk_tokens=chunk)
            outs[chunk] = out
        stats = [_tensors(o / "calibration" / EXPERT_STATS_DIR, "*.safetensors") for o in outs.values()]
        scales = [_tensors(o, "model-input-scales.safetensors") for o in outs.values()]
        rel = [float((a - stats[1][k]).norm() / a.norm().clamp_min(1e-30)) for k, a in stats[0].items()
               if a.is_floating_point()]
        differing_stats = sum(not torch.equal(a, stats[1][k]) for k, a in stats[0].items())
        for out in outs.values():
            requantize_checkpoint(out, DEMO_CHECKPOINT, method="gptq", progress=False)
        shards = [_tensors(o, "model-0*.safetensors") for o in outs.values()]
        expert_keys = [k for k in shards[0] if ".experts." in k and k.endswith(".weight")]
        codes = sum(shards[0][k].numel() for k in expert_keys)
        differing_codes = sum(int((shards[0][k] != shards[1][k]).sum()) for k in expert_keys)
        result = {
            **provenance(), "samples": args.samples, "seq_len": args.seq_len, "other_chunk": args.other_chunk,
            "input_scales_identical": all(torch.equal(a, scales[1][k]) for k, a in scales[0].items()),
            "statistics_tensors": len(stats[0]), "statistics_tensors_differing": differing_stats,
            "statistics_max_relative_difference": max(rel) if rel else 0.0,
            "expert_weight_bytes": codes, "expert_weight_bytes_differing": differing_codes,
        }
    print(json.dumps({k: v for k, v in result.items() if not isinstance(v, (dict, list))}, indent=2))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
