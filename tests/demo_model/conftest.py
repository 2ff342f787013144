"""Fixtures for the demo-model tests: a tiny spec, a tokenizer trained on a few stdlib files, and a
randomly initialised tiny K2 exported as a real K2.6-layout checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kimi_nvfp4.demo_model.corpus import default_source_root
from kimi_nvfp4.demo_model.model_config import TinyK2Spec

# Small enough to build in well under a second; every expert dim a multiple of 32.
TEST_SPEC = TinyK2Spec(vocab_size=768, hidden_size=64, num_hidden_layers=3, intermediate_size=64,
                       moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
                       num_attention_heads=2, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
                       qk_rope_head_dim=8, v_head_dim=16)
STDLIB_SAMPLE = ("json/decoder.py", "json/encoder.py", "textwrap.py", "fnmatch.py", "shlex.py", "glob.py",
                 "bisect.py", "heapq.py", "colorsys.py", "keyword.py", "string.py", "stat.py")


@pytest.fixture(scope="session")
def test_spec() -> TinyK2Spec:
    return TEST_SPEC


@pytest.fixture(scope="session")
def sample_source_root(tmp_path_factory) -> Path:
    """A folder of a dozen real stdlib modules (paths kept, so the hash split applies)."""
    root = tmp_path_factory.mktemp("stdlib_sample")
    src = default_source_root()
    for rel in STDLIB_SAMPLE:
        dst = root / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_text((src / rel).read_text(encoding="utf-8"), encoding="utf-8")
    return root


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory, sample_source_root) -> Path:
    from kimi_nvfp4.demo_model.tokenizer_build import train_tokenizer, write_tokenizer_files

    texts = [p.read_text(encoding="utf-8") for p in sorted(sample_source_root.rglob("*.py"))]
    out = tmp_path_factory.mktemp("tokenizer")
    write_tokenizer_files(train_tokenizer(texts, TEST_SPEC.vocab_size), out, TEST_SPEC.vocab_size)
    return out


@pytest.fixture(scope="session")
def random_tiny_model():
    from transformers import DeepseekV3ForCausalLM

    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(TEST_SPEC.transformers_config()).eval()
    with torch.no_grad():  # a non-zero correction bias, as training leaves it
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn(buf.shape) * 0.01)
    return model


@pytest.fixture(scope="session")
def exported_tiny(tmp_path_factory, random_tiny_model, tiny_tokenizer_dir) -> Path:
    from kimi_nvfp4.demo_model.export import export_checkpoint

    out = tmp_path_factory.mktemp("export") / "tiny_k2"
    return export_checkpoint(random_tiny_model.state_dict(), TEST_SPEC, tiny_tokenizer_dir, out, seed=0)
