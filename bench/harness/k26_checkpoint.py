"""A synthetic K2.6-shaped INT4 checkpoint and its NVFP4 conversion, built once per work folder and reused, the
token sequences run through it, and the model FLOPs per token of one MoE layer (the speed benches' projections)."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from kimi_nvfp4.checkpoint.reader import CheckpointReader
from kimi_nvfp4.convert.api import convert_checkpoint
from kimi_nvfp4.synth import create_synthetic_checkpoint

K26_LAYERS = 61
K26_DENSE_LAYERS = 1
# bf16 dense matrix rate of one H200 measured on this workplace's machines (device tool KINDS.md: an
# 8192^3 bf16 product at 769-798 TFLOP/s on random data); the fraction of peak below is against this.
H200_BF16_MEASURED_TFLOPS = 790.0


def moe_layer_flops_per_token(cfg, seq_len: int) -> float:
    """Model FLOPs of one token through one K2 MoE layer (one stream): top-k routed + shared SwiGLU
    experts, the MLA projections, and causal attention over on average seq_len/2 keys."""
    h, inter = cfg.hidden_size, cfg.moe_intermediate_size
    experts = (cfg.num_experts_per_tok + (cfg.n_shared_experts or 0)) * 3 * 2 * h * inter
    heads, qk, v = cfg.num_attention_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim
    q = 2 * (h * cfg.q_lora_rank + cfg.q_lora_rank * heads * qk) if cfg.q_lora_rank else 2 * h * heads * qk
    kv = 2 * (h * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) + cfg.kv_lora_rank * heads * (cfg.qk_nope_head_dim + v))
    o = 2 * heads * v * h
    scores = 2 * heads * (qk + v) * seq_len / 2
    return experts + q + kv + o + scores


def prepare(
    work: Path, preset: str, layers: int, device: str, experts: int | None = None, vocab_size: int | None = None,
    synth_device: str = "cpu",
) -> tuple[Path, Path]:
    """`experts`/`vocab_size` shrink the synthetic checkpoint (384 experts: ~15 s with `synth_device="cuda"`,
    minutes on a CPU)."""
    tag = f"{preset}_{layers}l" + (f"_{experts}e" if experts else "") + (f"_{vocab_size}v" if vocab_size else "")
    src, out = work / f"{tag}_int4", work / f"{tag}_nvfp4"
    if not (src / "config.json").exists():
        t = time.perf_counter()
        extra = {"vocab_size": vocab_size} if vocab_size else {}
        create_synthetic_checkpoint(
            src, preset=preset, layers=layers, experts=experts, progress=True, device=synth_device, **extra
        )
        print(f"synth: {time.perf_counter() - t:.1f} s")
    if not (out / "kimi_nvfp4_manifest.json").exists():
        t = time.perf_counter()
        convert_checkpoint(src, out, device=device, progress=True)
        print(f"convert: {time.perf_counter() - t:.1f} s")
    return src, out


def sequences(reader: CheckpointReader, out: Path, samples: int, seq_len: int, data: str | None, seed: int):
    if data:
        from kimi_nvfp4.stage_kit.samples import DataPart, load_sample_set

        return load_sample_set(
            out, data, part=DataPart.CALIBRATION, samples=samples, seq_len=seq_len, seed=seed
        ).sequences
    g = torch.Generator().manual_seed(seed)
    vocab = reader.layout.text.vocab_size
    return [torch.randint(0, vocab, (seq_len,), generator=g) for _ in range(samples)]
