"""Kimi's special tokens, placed in the tiny vocabulary the way Kimi K2 places them.

Kimi K2.x reserves the top 256 ids of its 163840-token vocabulary for special tokens, starting at
163584 (SPEC §1). The tiny model keeps that shape: its vocabulary ends in the same 256-id block,
each special at the same offset from the block start as in Kimi's `tokenizer_config.json`
(`[BOS]` +0, `<|im_end|>` +2, `<|im_middle|>` +17, `<think>` +22, `[PAD]` +255, ...), so code that
reads ids from a checkpoint's own files behaves the same on both.
"""

from __future__ import annotations

# Kimi K2: first special id 163584, vocab 163840 -> a block of 256 specials at the top.
KIMI_SPECIAL_BLOCK_START = 163584
SPECIAL_BLOCK_SIZE = 256

# Offsets from the block start, read off Kimi K2.6's ids (SPEC §1; media tokens 163602..163605
# from its tokenizer_config.json added_tokens_decoder).
KIMI_SPECIAL_OFFSETS: dict[str, int] = {
    "[BOS]": 0,
    "[EOS]": 1,
    "<|im_end|>": 2,
    "<|im_user|>": 3,
    "<|im_assistant|>": 4,
    "<|im_system|>": 10,
    "<|tool_calls_section_begin|>": 11,
    "<|tool_calls_section_end|>": 12,
    "<|tool_call_begin|>": 13,
    "<|tool_call_argument_begin|>": 14,
    "<|tool_call_end|>": 15,
    "<|im_middle|>": 17,
    "<|media_begin|>": 18,
    "<|media_content|>": 19,
    "<|media_end|>": 20,
    "<|media_pad|>": 21,
    "<think>": 22,
    "</think>": 23,
    "[PAD]": 255,
}

BOS_TOKEN = "[BOS]"
EOS_TOKEN = "[EOS]"
PAD_TOKEN = "[PAD]"
# Generation stops at the end of an assistant turn (Kimi's generation_config eos is <|im_end|>).
END_OF_TURN_TOKEN = "<|im_end|>"
# Ids Kimi leaves unnamed in its block; named like Kimi names its own reserved slots.
RESERVED_TEMPLATE = "<|reserved_token_{}|>"


def special_tokens(vocab_size: int) -> dict[int, str]:
    """id -> token for the whole top block of a `vocab_size` vocabulary (named + reserved)."""
    if vocab_size <= SPECIAL_BLOCK_SIZE:
        raise ValueError(f"vocab_size {vocab_size} leaves no room for the {SPECIAL_BLOCK_SIZE} special ids")
    start = vocab_size - SPECIAL_BLOCK_SIZE
    by_offset = {offset: token for token, offset in KIMI_SPECIAL_OFFSETS.items()}
    return {start + o: by_offset.get(o, RESERVED_TEMPLATE.format(o)) for o in range(SPECIAL_BLOCK_SIZE)}


def special_id(token: str, vocab_size: int) -> int:
    """Id of a named Kimi special token in a `vocab_size` vocabulary."""
    return vocab_size - SPECIAL_BLOCK_SIZE + KIMI_SPECIAL_OFFSETS[token]
