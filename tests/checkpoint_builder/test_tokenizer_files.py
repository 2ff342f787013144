"""Kimi's special tokens from the one table: Kimi's own ids, synth's tiktoken config, the demo's tokenizer."""

from __future__ import annotations

import json

import pytest

from kimi_nvfp4.checkpoint_builder.tokenizer_files import (
    CHAT_SPECIAL_OFFSETS,
    KIMI_SPECIAL_OFFSETS,
    KIMI_VOCAB_SIZE,
    SPECIAL_BLOCK_SIZE,
    added_tokens_decoder,
    special_id,
    special_tokens,
    write_text_files,
)

# SPEC §1: Kimi K2.6's own ids in its 163840-token vocabulary.
KIMI_IDS = {"[BOS]": 163584, "[EOS]": 163585, "<|im_end|>": 163586, "<|im_user|>": 163587,
            "<|im_assistant|>": 163588, "<|im_system|>": 163594, "<|tool_calls_section_begin|>": 163595,
            "<|tool_calls_section_end|>": 163596, "<|tool_call_begin|>": 163597,
            "<|tool_call_argument_begin|>": 163598, "<|tool_call_end|>": 163599, "<|im_middle|>": 163601,
            "<think>": 163606, "</think>": 163607, "[PAD]": 163839}


@pytest.mark.parametrize("token", sorted(KIMI_IDS))
def test_offsets_give_kimis_ids(token):
    assert special_id(token) == KIMI_IDS[token] and special_id(token, KIMI_VOCAB_SIZE) == KIMI_IDS[token]


def test_named_only_or_the_whole_block():
    named = special_tokens(KIMI_VOCAB_SIZE, reserved=False)
    assert sorted(named.values()) == sorted(KIMI_SPECIAL_OFFSETS) and min(named) == 163584
    block = special_tokens(1024, CHAT_SPECIAL_OFFSETS)
    assert sorted(block) == list(range(1024 - SPECIAL_BLOCK_SIZE, 1024)) and block[1023] == "[PAD]"
    assert block[1024 - SPECIAL_BLOCK_SIZE + KIMI_SPECIAL_OFFSETS["[UNK]"]].startswith("<|reserved_token_")
    with pytest.raises(ValueError, match="special ids"):
        special_tokens(SPECIAL_BLOCK_SIZE)


def test_synth_tokenizer_config_names_kimis_specials_at_their_ids():
    from kimi_nvfp4.synth.tokenizer_files import tokenizer_config

    decoder = tokenizer_config()["added_tokens_decoder"]
    assert {int(i): e["content"] for i, e in decoder.items()} == special_tokens(KIMI_VOCAB_SIZE, reserved=False)
    assert list(decoder) == sorted(decoder, key=int)


def test_demo_tokenizer_config_is_the_shipped_one():
    from kimi_nvfp4.demo_model import DEMO_CHECKPOINT
    from kimi_nvfp4.demo_model.tokenizer_build import TOKENIZER_CONFIG_FILE, tokenizer_config

    shipped = json.loads((DEMO_CHECKPOINT / TOKENIZER_CONFIG_FILE).read_text())
    vocab_size = json.loads((DEMO_CHECKPOINT / "config.json").read_text())["text_config"]["vocab_size"]
    assert tokenizer_config(vocab_size) == shipped


def test_files_are_written_whole(tmp_path):
    paths = write_text_files(tmp_path / "tok", {"a.json": "{}\n", "b.txt": "ünïcode"})
    assert [p.read_text(encoding="utf-8") for p in paths] == ["{}\n", "ünïcode"]
    assert sorted(p.name for p in (tmp_path / "tok").iterdir()) == ["a.json", "b.txt"]  # no partial left
    assert added_tokens_decoder({5: "x"})["5"]["special"] is True
