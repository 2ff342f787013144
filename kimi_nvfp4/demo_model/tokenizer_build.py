"""Train the tiny model's byte-level BPE tokenizer and write it with Kimi's special tokens.

Files written (what `kimi_nvfp4.data.tokenizer.load_tokenizer` and transformers read):
- `tokenizer.json`: a `tokenizers` byte-level BPE; the pre-tokenizer splits text with the
  cl100k-style pattern tiktoken tokenizers (Kimi's included) use for code, then maps bytes;
- `tokenizer_config.json`: `added_tokens_decoder` with every id of the special block (the checkpoint
  builder's, kimi_nvfp4/checkpoint_builder/tokenizer_files.py), bos/eos/pad tokens and the chat template;
- `chat_template.jinja`: the same template as a file (K2.6 ships it this way).
The BPE vocabulary fills ids `[0, vocab_size - 256)`; Kimi's specials occupy the top 256 ids at
Kimi's own offsets (see `specials.py`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

from ..checkpoint_builder.tokenizer_files import added_tokens_decoder, write_text_files
from .chat_template import KIMI_CHAT_TEMPLATE
from .specials import BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, SPECIAL_BLOCK_SIZE, special_tokens

DEFAULT_VOCAB_SIZE = 4096
# Pre-tokenization split as in tiktoken's cl100k_base (numbers in runs of at most 3 digits,
# whitespace runs kept apart from the word that follows, so indentation becomes its own tokens).
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
MODEL_MAX_LENGTH = 4096


def train_tokenizer(texts: Iterable[str], vocab_size: int = DEFAULT_VOCAB_SIZE):
    """A `tokenizers.Tokenizer` whose ids `[0, vocab_size)` are BPE tokens then Kimi's specials."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    bpe_size = vocab_size - SPECIAL_BLOCK_SIZE
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=bpe_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(texts, trainer)
    if tok.get_vocab_size() != bpe_size:
        raise ValueError(f"BPE training produced {tok.get_vocab_size()} tokens, expected {bpe_size}: corpus too small")
    specials = special_tokens(vocab_size)
    # Added in id order, so each lands on its id (added tokens are appended after the BPE vocab).
    tok.add_special_tokens([AddedToken(specials[i], special=True, normalized=False) for i in sorted(specials)])
    for i, content in specials.items():
        if tok.token_to_id(content) != i:
            raise AssertionError(f"special token {content} got id {tok.token_to_id(content)}, expected {i}")
    return tok


def tokenizer_config(vocab_size: int) -> dict:
    return {
        "added_tokens_decoder": added_tokens_decoder(special_tokens(vocab_size)),
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MODEL_MAX_LENGTH,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": KIMI_CHAT_TEMPLATE,
    }


def write_tokenizer_files(tokenizer, out_dir: Path, vocab_size: int) -> list[Path]:
    """Write tokenizer.json, tokenizer_config.json and chat_template.jinja atomically."""
    return write_text_files(out_dir, {
        TOKENIZER_FILE: tokenizer.to_str(pretty=False),
        TOKENIZER_CONFIG_FILE: json.dumps(tokenizer_config(vocab_size), indent=2, ensure_ascii=False) + "\n",
        CHAT_TEMPLATE_FILE: KIMI_CHAT_TEMPLATE,
    })


def load_tokenizer_json(directory: Path):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(Path(directory) / TOKENIZER_FILE))
