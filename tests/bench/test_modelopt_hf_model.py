"""bench/harness/modelopt_cpu/hf_model.py: transformers' DeepseekV3 holding the dequantized INT4 demo checkpoint computes
the same logits as our INT4 reference model, so Model Optimizer's recipes are run on the model validate measures."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

pytest.importorskip("transformers")

from bench.harness.modelopt_cpu.hf_model import load_deepseek_v3  # noqa: E402
from kimi_nvfp4.checkpoint.reader import CheckpointReader  # noqa: E402
from kimi_nvfp4.demo_model import DEMO_CHECKPOINT  # noqa: E402
from kimi_nvfp4.model import Int4SourceWeights, LayerStreamRunner  # noqa: E402

# fp32 logits of magnitude ~20: the two models sum in different orders (fused vs per-expert matmuls, einsum vs
# matmul attention), ~1e-5 apart on the demo model; a wrong weight, norm eps or rope would move them by >1e-2.
LOGITS_ATOL = 1e-4
SEQ_LEN = 192


def test_logits_equal_the_int4_reference_model():
    model = load_deepseek_v3(DEMO_CHECKPOINT)
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    sequences = [torch.randint(0, vocab, (SEQ_LEN,), generator=gen) for _ in range(2)]
    ref = LayerStreamRunner(Int4SourceWeights(CheckpointReader(DEMO_CHECKPOINT)), progress=False)
    with torch.no_grad():
        for seq, ref_logits in zip(sequences, ref.run(sequences)):
            logits = model(seq[None]).logits[0]
            torch.testing.assert_close(logits, ref_logits, atol=LOGITS_ATOL, rtol=0.0)


def test_routed_experts_are_the_fused_parameters_of_the_int4_experts():
    model = load_deepseek_v3(DEMO_CHECKPOINT)
    src = Int4SourceWeights(CheckpointReader(DEMO_CHECKPOINT))
    layer = next(i for i in range(model.config.num_hidden_layers) if src.layer(i).is_moe)
    w = src.layer(layer)
    experts = model.model.layers[layer].mlp.experts
    last = len(w.mlp.experts) - 1
    torch.testing.assert_close(experts.gate_up_proj[last],
                               torch.cat([w.mlp.experts[last].gate_proj.weight(), w.mlp.experts[last].up_proj.weight()]),
                               atol=0.0, rtol=0.0)
    torch.testing.assert_close(experts.down_proj[0], w.mlp.experts[0].down_proj.weight(), atol=0.0, rtol=0.0)
