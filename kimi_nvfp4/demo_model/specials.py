"""Kimi's special tokens in the tiny vocabulary: the top 256 ids, each at Kimi's offset from the block start
(the table and the rule are the checkpoint builder's, kimi_nvfp4/checkpoint_builder/tokenizer_files.py).

The tiny model names the specials its chat format uses (`DEMO_SPECIAL_OFFSETS`); the others Kimi names
(`<|start_header_id|>`, `[EOT]`, `[UNK]`, ...) stay reserved slots in its tokenizer, as they are in the
shipped `tokenizer.json`.
"""

from __future__ import annotations

from ..checkpoint_builder.tokenizer_files import (
    BOS_TOKEN,
    CHAT_SPECIAL_OFFSETS,
    END_OF_TURN_TOKEN,
    EOS_TOKEN,
    PAD_TOKEN,
    RESERVED_TEMPLATE,
    SPECIAL_BLOCK_SIZE,
    special_id,
)
from ..checkpoint_builder.tokenizer_files import special_tokens as kimi_special_tokens

DEMO_SPECIAL_OFFSETS: dict[str, int] = dict(CHAT_SPECIAL_OFFSETS)

__all__ = ["BOS_TOKEN", "DEMO_SPECIAL_OFFSETS", "END_OF_TURN_TOKEN", "EOS_TOKEN", "PAD_TOKEN", "RESERVED_TEMPLATE",
           "SPECIAL_BLOCK_SIZE", "special_id", "special_tokens"]


def special_tokens(vocab_size: int) -> dict[int, str]:
    """id -> token for the whole top block of a `vocab_size` vocabulary (named + reserved)."""
    return kimi_special_tokens(vocab_size, DEMO_SPECIAL_OFFSETS)
