"""FP8 KV cache on the demo model: what calibrated `k_scale`/`v_scale` change against scale 1.0 (issue 15, CPU).

1. The demo checkpoint is converted and calibrated (builtin sessions, as docs/benchmarks.md §5: 4 x 256 tokens,
   --min-expert-tokens 64); calibrate measures each layer's MLA cache amax (latent after kv_a_layernorm, roped
   key) and writes `k_scale`/`v_scale` = max(amax / 448, 1.0) (calibrate/kv_cache.py).
2. On held-out windows (16 x 256 tokens, disjoint from the calibration sessions) the reference model (the INT4
   source, fp32) decodes token by token, so every token reads the whole cache back, in five ways:
   - `bf16-cache`: the cache unquantized (the reference the others are compared with);
   - `fp8-scale-1`: latent and rope key through E4M3 with scale 1.0 (SGLang without checkpoint scales);
   - `fp8-written`: with the scales calibrate writes (Model Optimizer's rule);
   - `fp8-amax-over-448`: with amax / 448 applied on write and on read (an engine that honours any scale);
   - `sglang-unclamped`: what SGLang 0.5.23's MLA decode computes if a checkpoint carried amax / 448 unclamped:
     the cache written as a plain FP8 cast (`quant_scale_kv=1.0`) but the scores multiplied by k_scale
     (trtllm_mla_backend.py `bmm1_scale = q_scale * k_scale * layer.scaling`).
   KL(reference || variant) per token (mean, p99), top-1 agreement, and perplexity of the actual next token.
Writes bench/results/kv_cache_scales.json.

    python -m bench.quality.kv_cache_scales --work-dir /tmp/kimi_nvfp4_kv
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import shutil
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.harness.provenance import REPO_ROOT, provenance

RESULTS = REPO_ROOT / "bench" / "results" / "kv_cache_scales.json"


def _decode(model, ids: torch.Tensor, transform, ropes) -> torch.Tensor:
    """Logits [T, vocab] of `ids` decoded one token at a time; `transform(layer, cache)` is what the cache holds
    after each write; `ropes[layer]` the rotary/softmax-scale object layer `layer` attends with."""
    from kimi_nvfp4.model.attention import rms_norm
    from kimi_nvfp4.model.decoder import attention_block, mlp_block

    cfg = model["cfg"]
    caches = [None] * len(model["layers"])
    out = []
    for t in range(ids.numel()):
        x = model["embed"][ids[t : t + 1]]
        for i, w in enumerate(model["layers"]):
            h, cache = attention_block(cfg, ropes[i], w, x, past=caches[i])
            x = mlp_block(cfg, w, h)
            caches[i] = transform(i, cache)
        out.append(F.linear(rms_norm(x, model["norm"], cfg.rms_norm_eps), model["head"]))
    return torch.cat(out)


def _metrics(ref: list[torch.Tensor], got: list[torch.Tensor], ids: list[torch.Tensor]) -> dict[str, float]:
    kls, agree, nll, n = [], 0, 0.0, 0
    for r, g, seq in zip(ref, got, ids):
        lr, lg = F.log_softmax(r.double(), -1), F.log_softmax(g.double(), -1)
        kls.append((lr.exp() * (lr - lg)).sum(-1))
        agree += int((r.argmax(-1) == g.argmax(-1)).sum())
        nll -= float(lg[:-1].gather(-1, seq[1:, None]).sum())
        n += r.shape[0]
    kl = torch.cat(kls)
    finite = torch.isfinite(kl)
    return {
        "kl_mean": float(kl[finite].mean()) if finite.any() else math.inf,
        "kl_p99": float(torch.quantile(kl[finite], 0.99)) if finite.any() else math.inf,
        "top1": agree / n,
        "ppl": math.exp(nll / max(1, n - len(ids))),
        "non_finite_tokens": int((~finite).sum()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work-dir", type=Path, default=Path("/tmp/kimi_nvfp4_kv"))
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--min-expert-tokens", type=int, default=64)
    ap.add_argument("--heldout-samples", type=int, default=16)
    ap.add_argument("--json", type=Path, default=RESULTS)
    ap.add_argument("--reuse", action="store_true", help="keep a calibrated checkpoint already in --work-dir")
    args = ap.parse_args()

    from kimi_nvfp4.calibrate import calibrate_checkpoint
    from kimi_nvfp4.calibrate.kv_cache import KVCacheCalibration, fake_quant_fp8
    from kimi_nvfp4.convert import convert_checkpoint
    from kimi_nvfp4.demo_model import DEMO_CHECKPOINT
    from kimi_nvfp4.model import open_weights
    from kimi_nvfp4.model.attention import LatentKV
    from kimi_nvfp4.model.rope import RotaryEmbedding
    from kimi_nvfp4.numerics.constants import E4M3_MAX
    from kimi_nvfp4.stage_kit.samples import DataPart, load_sample_set

    torch.set_grad_enabled(False)
    out = args.work_dir / "demo_nvfp4"
    report_file = out / "calibration" / "calibration_report.json"
    if not (args.reuse and report_file.is_file()):
        shutil.rmtree(out, ignore_errors=True)
        convert_checkpoint(DEMO_CHECKPOINT, out, device="cpu", progress=False, record_stats=False)
        calibrate_checkpoint(out, DEMO_CHECKPOINT, "builtin", samples=args.samples, seq_len=args.seq_len,
                             min_expert_tokens=args.min_expert_tokens, device="cpu", progress=False)
    kv = KVCacheCalibration.model_validate(json.loads(report_file.read_text())["kv_cache"])
    written = [e.scale for e in kv.layers]
    unclamped = [e.amax / E4M3_MAX for e in kv.layers]

    source = open_weights(DEMO_CHECKPOINT)
    cfg = source.config
    model = {
        "cfg": cfg,
        "layers": [source.layer(i, "cpu", torch.float32) for i in range(cfg.num_hidden_layers)],
        "embed": source.embed("cpu").to(torch.float32),
        "norm": source.final_norm("cpu"),
        "head": source.lm_head("cpu").to(torch.float32),
    }
    for w in model["layers"]:
        w.materialize()
    rope = RotaryEmbedding.from_config(cfg)
    same_rope = [rope] * cfg.num_hidden_layers
    heldout = load_sample_set(out, "builtin", part=DataPart.HELDOUT, samples=args.heldout_samples,
                              seq_len=args.seq_len, seed=0).sequences

    def through_fp8(scales):
        return lambda i, c: LatentKV(fake_quant_fp8(c.latent, scales[i]), fake_quant_fp8(c.k_pe, scales[i]))

    def scored_by(scales):
        return [dataclasses.replace(rope, softmax_scale=rope.softmax_scale * s) for s in scales]

    ones = [1.0] * cfg.num_hidden_layers
    variants = {
        "bf16-cache": (lambda i, c: c, same_rope),
        "fp8-scale-1": (through_fp8(ones), same_rope),
        "fp8-written": (through_fp8(written), same_rope),
        "fp8-amax-over-448": (through_fp8(unclamped), same_rope),
        "sglang-unclamped": (through_fp8(ones), scored_by(unclamped)),
    }
    logits: dict[str, list[torch.Tensor]] = {}
    seconds: dict[str, float] = {}
    same_as = {"fp8-written": "fp8-scale-1"} if written == ones else {}  # identical computation: not run twice
    for name, (transform, ropes) in variants.items():
        if name in same_as:
            logits[name], seconds[name] = logits[same_as[name]], 0.0
            print(f"{name}: every written scale is 1.0, the same computation as {same_as[name]}", flush=True)
            continue
        t0 = time.perf_counter()
        logits[name] = []
        for k, ids in enumerate(heldout):
            logits[name].append(_decode(model, ids.reshape(-1), transform, ropes))
            print(f"{name}: sequence {k + 1}/{len(heldout)} ({time.perf_counter() - t0:.0f} s)", flush=True)
        seconds[name] = time.perf_counter() - t0
    ids = [s.reshape(-1) for s in heldout]
    rows = []
    for name in variants:
        row = {"variant": name, **_metrics(logits["bf16-cache"], logits[name], ids), "seconds": seconds[name]}
        print(json.dumps(row), flush=True)
        rows.append(row)
    result = {
        **provenance(device="cpu"),
        "model": "bundled demo (tiny K2, INT4 source, fp32 reference model), decoded token by token",
        "calibration": {"data": "builtin", "samples": args.samples, "seq_len": args.seq_len,
                        "min_expert_tokens": args.min_expert_tokens},
        "heldout": {"samples": len(heldout), "tokens": sum(int(s.numel()) for s in heldout)},
        "written_scales_all_one": written == ones,
        "kv_cache": kv.model_dump(),
        "rows": rows,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
