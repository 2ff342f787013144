"""Kimi special tokens: ids at Kimi's offsets, single ids in text, tokenizer files that agree."""

from __future__ import annotations

import json

import pytest

from kimi_nvfp4.demo_model.specials import DEMO_SPECIAL_OFFSETS, SPECIAL_BLOCK_SIZE, special_id, special_tokens
from kimi_nvfp4.demo_model.tokenizer_build import load_tokenizer_json

# SPEC §1: Kimi K2.6's own ids in its 163840-token vocabulary.
KIMI_IDS = {"[BOS]": 163584, "[EOS]": 163585, "<|im_end|>": 163586, "<|im_user|>": 163587,
            "<|im_assistant|>": 163588, "<|im_system|>": 163594, "<|tool_calls_section_begin|>": 163595,
            "<|tool_calls_section_end|>": 163596, "<|tool_call_begin|>": 163597,
            "<|tool_call_argument_begin|>": 163598, "<|tool_call_end|>": 163599, "<|im_middle|>": 163601,
            "<think>": 163606, "</think>": 163607, "[PAD]": 163839}
KIMI_VOCAB = 163840


@pytest.mark.parametrize("token", sorted(KIMI_IDS))
def test_offsets_reproduce_kimi_ids_in_a_kimi_sized_vocab(token):
    assert special_id(token, KIMI_VOCAB) == KIMI_IDS[token]


def test_special_block_is_the_top_256_ids_with_reserved_names_for_the_rest():
    table = special_tokens(4096)
    assert sorted(table) == list(range(4096 - SPECIAL_BLOCK_SIZE, 4096))
    assert table[4095] == "[PAD]" and table[3840] == "[BOS]"
    assert len(set(table.values())) == SPECIAL_BLOCK_SIZE
    reserved = sum(1 for t in table.values() if t.startswith("<|reserved_token_"))
    assert reserved == SPECIAL_BLOCK_SIZE - len(DEMO_SPECIAL_OFFSETS)


def test_vocab_too_small_for_the_special_block_is_refused():
    with pytest.raises(ValueError, match="special ids"):
        special_tokens(SPECIAL_BLOCK_SIZE)


@pytest.mark.parametrize("token", sorted(DEMO_SPECIAL_OFFSETS))
def test_each_special_token_is_one_id_even_inside_text(tiny_tokenizer_dir, test_spec, token):
    tok = load_tokenizer_json(tiny_tokenizer_dir)
    ids = tok.encode(f"x = 1{token}def f():").ids
    assert special_id(token, test_spec.vocab_size) in ids
    assert tok.decode([special_id(token, test_spec.vocab_size)], skip_special_tokens=False) == token


@pytest.mark.parametrize("text", [
    "def f(x):\n    return x ** 2  # square\n",
    "\tif a != b:\n\t\tpass\r\n",
    "s = 'héllo wörld — ✓ 你好'\n",
    "x = 1234567890\n\n\n    \n",
])
def test_decode_inverts_encode(tiny_tokenizer_dir, text):
    tok = load_tokenizer_json(tiny_tokenizer_dir)
    assert tok.decode(tok.encode(text).ids) == text


def test_tokenizer_config_agrees_with_tokenizer_json(tiny_tokenizer_dir, test_spec):
    tok = load_tokenizer_json(tiny_tokenizer_dir)
    cfg = json.loads((tiny_tokenizer_dir / "tokenizer_config.json").read_text())
    assert tok.get_vocab_size() == test_spec.vocab_size
    for id_str, entry in cfg["added_tokens_decoder"].items():
        assert tok.token_to_id(entry["content"]) == int(id_str) and entry["special"] is True
    for key in ("bos_token", "eos_token", "pad_token"):
        assert tok.token_to_id(cfg[key]) == special_id(cfg[key], test_spec.vocab_size)
    assert cfg["chat_template"] == (tiny_tokenizer_dir / "chat_template.jinja").read_text()


def test_tokenizer_loads_in_transformers_without_remote_code(tiny_tokenizer_dir, test_spec):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_tokenizer_dir))
    assert tok.convert_tokens_to_ids("<|im_end|>") == special_id("<|im_end|>", test_spec.vocab_size)
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_assistant|>assistant<|im_middle|><think>")
