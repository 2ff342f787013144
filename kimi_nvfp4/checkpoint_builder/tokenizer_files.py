"""The tokenizer side of a Kimi K2-layout checkpoint: Kimi's special tokens, their `tokenizer_config.json`
entries, and writing the files (docs/formats.md §1).

Kimi K2.x reserves the top 256 ids of its 163840-token vocabulary for special tokens, from 163584
(tokenization_kimi.py `num_reserved_special_tokens`). A smaller vocabulary keeps that shape: the same 256-id
block at its top, each special at Kimi's offset from the block start, so code that reads ids from a checkpoint's
own files behaves the same on every checkpoint. Two tokenizer kinds are written with it: synth's tiktoken ranks
(Kimi's own format) and the demo model's trained `tokenizer.json`.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..checkpoint.writer import write_bytes_atomic

KIMI_VOCAB_SIZE = 163840
SPECIAL_BLOCK_SIZE = 256

# Kimi K2.6's named special tokens by offset from the first special id (docs/formats.md §1; K2.6's
# tokenizer_config.json `added_tokens_decoder`: 163584 + offset).
KIMI_SPECIAL_OFFSETS: dict[str, int] = {
    "[BOS]": 0,
    "[EOS]": 1,
    "<|im_end|>": 2,
    "<|im_user|>": 3,
    "<|im_assistant|>": 4,
    "<|start_header_id|>": 6,
    "<|end_header_id|>": 7,
    "[EOT]": 9,
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
    "[UNK]": 254,
    "[PAD]": 255,
}
# Specials Kimi's chat format never writes (a byte-level BPE needs no [UNK]); a checkpoint may leave their slots
# reserved, as the demo model's tokenizer does.
UNUSED_BY_CHAT_FORMAT = frozenset({"<|start_header_id|>", "<|end_header_id|>", "[EOT]", "[UNK]"})
CHAT_SPECIAL_OFFSETS: dict[str, int] = {
    token: offset for token, offset in KIMI_SPECIAL_OFFSETS.items() if token not in UNUSED_BY_CHAT_FORMAT
}

BOS_TOKEN = "[BOS]"
EOS_TOKEN = "[EOS]"
PAD_TOKEN = "[PAD]"
UNK_TOKEN = "[UNK]"
MEDIA_PLACEHOLDER_TOKEN = "<|media_pad|>"
# Generation stops at the end of an assistant turn (Kimi's generation_config eos is <|im_end|>).
END_OF_TURN_TOKEN = "<|im_end|>"
# Ids Kimi leaves unnamed in its block; named like Kimi names its own reserved slots.
RESERVED_TEMPLATE = "<|reserved_token_{}|>"


def special_id(token: str, vocab_size: int = KIMI_VOCAB_SIZE) -> int:
    """Id of a named Kimi special token in a `vocab_size` vocabulary (Kimi's own id at 163840)."""
    return vocab_size - SPECIAL_BLOCK_SIZE + KIMI_SPECIAL_OFFSETS[token]


def special_tokens(vocab_size: int, names: Mapping[str, int] = KIMI_SPECIAL_OFFSETS, *,
                   reserved: bool = True) -> dict[int, str]:
    """id -> token of the special block of a `vocab_size` vocabulary.

    :param names: the named tokens and their offsets (default: all of Kimi's).
    :param reserved: also name every other id of the block `<|reserved_token_N|>` (the whole block).
    """
    if vocab_size <= SPECIAL_BLOCK_SIZE:
        raise ValueError(f"vocab_size {vocab_size} leaves no room for the {SPECIAL_BLOCK_SIZE} special ids")
    start = vocab_size - SPECIAL_BLOCK_SIZE
    by_offset = {offset: token for token, offset in names.items()}
    offsets = range(SPECIAL_BLOCK_SIZE) if reserved else sorted(by_offset)
    return {start + o: by_offset.get(o, RESERVED_TEMPLATE.format(o)) for o in offsets}


def added_tokens_decoder(tokens: Mapping[int, str]) -> dict[str, dict[str, Any]]:
    """tokenizer_config.json's `added_tokens_decoder`: every special token, in id order."""
    return {
        str(i): {"content": token, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                 "special": True}
        for i, token in sorted(tokens.items())
    }


def write_text_files(out_dir: str | Path, files: Mapping[str, str]) -> list[Path]:
    """Write each `name: text` into `out_dir` (UTF-8), each under a temporary name renamed when complete."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        write_bytes_atomic(out_dir / name, text.encode("utf-8"))
    return [out_dir / name for name in files]
