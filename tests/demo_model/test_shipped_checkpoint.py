"""The bundled tiny K2: K2.6 layout, Kimi tokenizer, and a trained model (accuracy gates that can fail)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from kimi_nvfp4.checkpoint.layout import LayoutKind, parse_expert_name
from kimi_nvfp4.checkpoint.reader import CheckpointReader
from kimi_nvfp4.demo_model import DEMO_CHECKPOINT
from kimi_nvfp4.demo_model.build import REPORT_FILE
from kimi_nvfp4.demo_model.chat_template import KIMI_CHAT_TEMPLATE
from kimi_nvfp4.demo_model.specials import DEMO_SPECIAL_OFFSETS, special_id
from kimi_nvfp4.demo_model.tokenizer_build import load_tokenizer_json

MAX_SHIPPED_MIB = 8.5
# Gates on the shipped model (measured: 11.7 code / 2.7 chat, see docs/demo_model.md).
MAX_HELDOUT_CODE_PPL = 16.0
MAX_INT4_PPL_INCREASE = 0.03  # relative, INT4 checkpoint vs the float32 model it came from


@pytest.fixture(scope="module")
def reader() -> CheckpointReader:
    return CheckpointReader(DEMO_CHECKPOINT)


@pytest.fixture(scope="module")
def report() -> dict:
    return json.loads((DEMO_CHECKPOINT / REPORT_FILE).read_text())


def test_shipped_checkpoint_is_a_k26_layout_int4_checkpoint(reader):
    assert reader.layout.kind is LayoutKind.KIMI_K25
    cfg = reader.layout.text
    assert cfg.first_k_dense_replace == 1 and len(cfg.moe_layers) >= 2
    assert cfg.n_routed_experts >= 8 and cfg.num_experts_per_tok == 2 and cfg.n_shared_experts == 1
    assert cfg.q_lora_rank and cfg.kv_lora_rank and cfg.scoring_func == "sigmoid"
    for qc in (reader.config["quantization_config"], reader.config["text_config"]["quantization_config"]):
        assert qc["format"] == "pack-quantized" and qc["config_groups"]["group_0"]["weights"]["group_size"] == 32
    packed = [n for n in reader.tensors if (p := parse_expert_name(n)) and p.suffix == "weight_packed"]
    assert len(packed) == len(cfg.moe_layers) * cfg.n_routed_experts * 3
    assert any(n.startswith("vision_tower.") for n in reader.tensors)
    assert any(n.startswith("mm_projector.") for n in reader.tensors)


def test_shipped_checkpoint_is_small(reader):
    assert sum(i.nbytes for i in reader.tensors.values()) / 2**20 <= MAX_SHIPPED_MIB


def test_router_correction_bias_was_trained_and_is_float32(reader):
    for layer in reader.layout.text.moe_layers:
        bias = reader.load(f"{reader.layout.layer_prefix(layer)}mlp.gate.e_score_correction_bias")
        assert bias.dtype == torch.float32 and float(bias.abs().max()) > 0


def test_shipped_tokenizer_carries_kimi_specials_and_the_template(reader):
    tok = load_tokenizer_json(DEMO_CHECKPOINT)
    vocab = reader.layout.text.vocab_size
    assert tok.get_vocab_size() == vocab
    for token in DEMO_SPECIAL_OFFSETS:
        assert tok.encode(token).ids == [special_id(token, vocab)]
    cfg = json.loads((DEMO_CHECKPOINT / "tokenizer_config.json").read_text())
    assert cfg["chat_template"] == KIMI_CHAT_TEMPLATE == (DEMO_CHECKPOINT / "chat_template.jinja").read_text()
    assert not list(DEMO_CHECKPOINT.glob("*.py")), "the demo checkpoint must ship no code"


def test_training_report_records_held_out_perplexity_within_gates(report):
    ppl = report["perplexity"]
    assert ppl["float32_code"]["tokens"] > 100_000
    assert ppl["int4_checkpoint_code"]["ppl"] <= MAX_HELDOUT_CODE_PPL
    for split in ("code", "chat"):
        fp, q = ppl[f"float32_{split}"]["ppl"], ppl[f"int4_checkpoint_{split}"]["ppl"]
        assert q / fp - 1 <= MAX_INT4_PPL_INCREASE
    losses = [loss for _, loss in report["train"]["heldout_losses"]]
    assert losses[-1] < losses[0]


def test_shipped_model_predicts_unseen_stdlib_code(report):
    """Perplexity, recomputed here through the exported INT4 checkpoint, on one held-out module."""
    from kimi_nvfp4.demo_model.corpus import default_source_root
    from kimi_nvfp4.demo_model.readback import load_transformers_model

    held_out = [f for f in report["corpus"]["heldout_files"] if not f.startswith("test")]
    path = next((default_source_root() / f for f in held_out if (default_source_root() / f).is_file()), None)
    if path is None:
        pytest.skip("no held-out module of the training corpus exists in this interpreter's stdlib")
    tok = load_tokenizer_json(DEMO_CHECKPOINT)
    ids = torch.tensor([tok.encode(path.read_text(encoding="utf-8")).ids[:257]])
    model = load_transformers_model(DEMO_CHECKPOINT)
    with torch.no_grad():
        logits = model(input_ids=ids[:, :-1]).logits[0]
    nll = torch.nn.functional.cross_entropy(logits, ids[0, 1:]).item()
    # An untrained model sits near ln(vocab) = 8.3 nats (perplexity ~4096); the trained one far below.
    assert math.exp(nll) < 3 * MAX_HELDOUT_CODE_PPL, f"{path.name}: perplexity {math.exp(nll):.1f}"


def test_shipped_model_closes_a_tool_call_it_opens():
    """Greedy decoding after a tool-call header writes JSON arguments and ends the call."""
    from kimi_nvfp4.demo_model.agent_chats import AGENT_TOOLS
    from kimi_nvfp4.demo_model.chat_template import render_chat
    from kimi_nvfp4.demo_model.readback import load_transformers_model

    tok = load_tokenizer_json(DEMO_CHECKPOINT)
    prompt = render_chat([{"role": "user", "content": "Where is `dumps` defined in `json/__init__.py`?"}],
                         AGENT_TOOLS, add_generation_prompt=True)
    prompt += "I should search json/__init__.py for the def.</think><|tool_calls_section_begin|><|tool_call_begin|>"
    ids = torch.tensor([tok.encode(prompt).ids])
    end_call = tok.token_to_id("<|tool_call_end|>")
    model = load_transformers_model(DEMO_CHECKPOINT)
    out: list[int] = []
    with torch.no_grad():
        for _ in range(40):
            nxt = int(model(input_ids=ids).logits[0, -1].argmax())
            out.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
            if nxt == end_call:
                break
    text = tok.decode(out, skip_special_tokens=False)
    assert text.startswith("functions.grep:0<|tool_call_argument_begin|>"), text
    assert text.endswith("<|tool_call_end|>"), text
    args = json.loads(text.split("<|tool_call_argument_begin|>")[1].removesuffix("<|tool_call_end|>"))
    assert args["path"] == "json/__init__.py"


def test_shipped_vision_config_has_k26_keys_and_fits_the_projector(reader):
    """SGLang's K2VLMultiModalProjector reads vt_hidden_size and text_hidden_size (K2.6 ships both)."""
    from kimi_nvfp4.demo_model.vision_stub import MERGE_KERNEL, vision_config

    v = reader.config["vision_config"]
    hidden = reader.layout.text.hidden_size
    assert v == vision_config(hidden)  # the asset is what the exporter writes
    for key in ("vt_hidden_size", "vt_num_hidden_layers", "vt_num_attention_heads", "vt_intermediate_size",
                "mm_hidden_size", "text_hidden_size"):
        assert key in v
    merged = v["vt_hidden_size"] * MERGE_KERNEL[0] * MERGE_KERNEL[1]
    assert reader.info("mm_projector.proj.0.weight").shape == (merged, merged)
    assert reader.info("mm_projector.proj.2.weight").shape == (v["text_hidden_size"], merged)
    assert v["text_hidden_size"] == hidden
