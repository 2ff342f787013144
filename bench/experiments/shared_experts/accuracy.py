"""Shared experts BF16 vs NVFP4 on the demo model (issue 19): convert -> calibrate -> validate per option, CPU.

Same data as docs/benchmarks.md §5 (builtin sessions, calibrate 4 x 256 tokens, min-expert-tokens 64,
validate 16 x 256, W4A16 and W4A4 modes, SGLang's layer-max input-scale reduction). Prints a JSON row per
option and writes them to --json.

    python -m bench.experiments.shared_experts.accuracy --work-dir /tmp/kimi_nvfp4_shared
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from bench.harness.provenance import provenance


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work-dir", type=Path, default=Path("/tmp/kimi_nvfp4_shared"))
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--min-expert-tokens", type=int, default=64)
    ap.add_argument("--validate-samples", type=int, default=16)
    ap.add_argument("--options", nargs="+", default=["bf16", "nvfp4", "nvfp4-mse"],
                    help="bf16, nvfp4 (amax block scales) or nvfp4-mse")
    ap.add_argument("--json", type=Path, default=Path("bench_shared_experts.json"))
    args = ap.parse_args()

    from kimi_nvfp4.calibrate import calibrate_checkpoint
    from kimi_nvfp4.convert import convert_checkpoint
    from kimi_nvfp4.demo_model import DEMO_CHECKPOINT
    from kimi_nvfp4.validate import validate_checkpoint

    rows = []
    for option in args.options:
        shared, _, rule = option.partition("-")
        out = args.work_dir / option
        shutil.rmtree(out, ignore_errors=True)
        convert_checkpoint(DEMO_CHECKPOINT, out, device="cpu", progress=False, shared_experts=shared,
                           shared_expert_scales=rule or "amax")
        calibrate_checkpoint(out, DEMO_CHECKPOINT, "builtin", samples=args.samples, seq_len=args.seq_len,
                             min_expert_tokens=args.min_expert_tokens, device="cpu", progress=False)
        v = validate_checkpoint(out, DEMO_CHECKPOINT, "builtin", report_dir=out / "validate",
                                samples=args.validate_samples, seq_len=args.seq_len, device="cpu",
                                progress=False, record_in_manifest=False)
        row = {"shared_experts": option, "passed": v.passed, "tokens": v.tokens,
               "checkpoint_tensor_bytes": json.loads((out / "model.safetensors.index.json").read_text())
               ["metadata"]["total_size"]}
        for e in v.end_to_end:
            row[e.mode] = {"kl_mean": e.kl_mean, "kl_p99": e.kl_p99, "top1": e.top1, "ppl_ratio": e.ppl_ratio}
        print(json.dumps(row), flush=True)
        rows.append(row)
    args.json.write_text(json.dumps({"device": "cpu", "model": "demo (kimi_nvfp4/assets/tiny_k2)", "data": "builtin",
                                     "samples": args.samples, "seq_len": args.seq_len,
                                     "min_expert_tokens": args.min_expert_tokens,
                                     "validate_samples": args.validate_samples, "rows": rows, **provenance()},
                                    indent=2) + "\n")


if __name__ == "__main__":
    main()
