"""bench/profile/moe_chunk.py: one chunk's record on the CPU -- its FLOPs, its profiled ops, and the switch to plain
products undone afterwards."""

from __future__ import annotations

import torch

from bench.profile import moe_chunk
from kimi_nvfp4.checkpoint.k2_config import K2Config
from kimi_nvfp4.model import batch_invariant
from kimi_nvfp4.synth.configs import deepseek_v3_text_config


def test_chunk_flops_count_the_routed_shared_and_router_products():
    cfg = K2Config.from_dict(deepseek_v3_text_config("k2.6", layers=2, experts=384))
    per_token = 8 * 3 * 2 * 7168 * 2048 + 3 * 2 * 7168 * 2048 + 2 * 7168 * 384
    assert moe_chunk.chunk_flops(cfg, 65536) == 65536 * per_token  # K2.6: top-8 of 384, one shared expert


def test_a_small_chunk_is_timed_and_profiled_and_the_products_switch_back():
    row = moe_chunk.measure(torch.device("cpu"), "int4", True, experts=4, tokens=32, repeats=1, invariant=False)
    assert row["mode"] == "int4" and row["materialized"] and row["invariant"] is False
    assert row["seconds"] > 0 and row["fraction_of_bf16_peak"] is None  # no GPU rate on the CPU
    assert any(k["name"] == "aten::mm" for k in row["kernels"])
    assert batch_invariant.BATCH_INVARIANT is True
