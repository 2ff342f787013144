"""Fixtures for kimi_nvfp4.data: tokenizer folders built on the fly (no network, no shipped model).

- `kimi_tiktoken_dir`: a Kimi-layout tokenizer folder: a synthetic `tiktoken.model` with exactly
  163584 ranks (256 bytes + byte pairs + byte triples) so special ids land where Kimi's do,
  `tokenizer_config.json` naming Kimi's specials (SPEC §1), the Kimi-style test template, and a
  `tokenization_kimi.py` that raises if anything ever imports it.
- `hf_tokenizer_dir`: a `tokenizer.json` trained with the `tokenizers` library on a small corpus,
  with Kimi's special tokens as added tokens, plus the same template.
"""

from __future__ import annotations

import base64
import itertools
import json
import shutil
from pathlib import Path

import pytest

HERE = Path(__file__).parent
TEMPLATE_PATH = HERE / "kimi_style_chat_template.jinja"

KIMI_NUM_BASE_TOKENS = 163584
# SPEC §1: Kimi K2.6's named special tokens and ids.
KIMI_SPECIAL_IDS = {
    "[BOS]": 163584, "[EOS]": 163585, "<|im_end|>": 163586, "<|im_user|>": 163587, "<|im_assistant|>": 163588,
    "<|im_system|>": 163594, "<|tool_calls_section_begin|>": 163595, "<|tool_calls_section_end|>": 163596,
    "<|tool_call_begin|>": 163597, "<|tool_call_argument_begin|>": 163598, "<|tool_call_end|>": 163599,
    "<|im_middle|>": 163601, "<think>": 163606, "</think>": 163607, "[PAD]": 163839,
}
POISON_MODULE = "raise RuntimeError('tokenization_kimi.py must never be imported')\n"


def added_tokens_decoder(special_ids: dict[str, int]) -> dict[str, dict]:
    return {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                     "special": True} for t, i in special_ids.items()}


def write_synthetic_tiktoken_model(path: Path, num_ranks: int) -> None:
    """Ranks 0..num_ranks-1: all 256 bytes, then byte pairs, then byte triples (in order)."""
    def tokens():
        yield from (bytes([b]) for b in range(256))
        yield from (bytes(p) for p in itertools.product(range(256), repeat=2))
        yield from (bytes(t) for t in itertools.product(range(256), repeat=3))
    lines = (f"{base64.b64encode(tok).decode()} {rank}" for rank, tok in zip(range(num_ranks), tokens()))
    path.write_text("\n".join(lines) + "\n", encoding="ascii")


def write_kimi_tokenizer_folder(folder: Path, num_ranks: int, special_ids: dict[str, int]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    write_synthetic_tiktoken_model(folder / "tiktoken.model", num_ranks)
    config = {
        "tokenizer_class": "TikTokenTokenizer",
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "bos_token": "[BOS]", "eos_token": "[EOS]", "pad_token": "[PAD]", "unk_token": None,
        "added_tokens_decoder": added_tokens_decoder(special_ids),
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": special_ids["<|im_end|>"]}))
    shutil.copy(TEMPLATE_PATH, folder / "chat_template.jinja")
    (folder / "tokenization_kimi.py").write_text(POISON_MODULE)
    return folder


@pytest.fixture(scope="session")
def kimi_tiktoken_dir(tmp_path_factory) -> Path:
    return write_kimi_tokenizer_folder(tmp_path_factory.mktemp("kimi_tok"), KIMI_NUM_BASE_TOKENS, KIMI_SPECIAL_IDS)


@pytest.fixture(scope="session")
def hf_tokenizer_dir(tmp_path_factory) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    folder = tmp_path_factory.mktemp("hf_tok")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["def read_file(path):\n    return open(path).read()\n", "grep found 3 matches in json/decoder.py",
              "You are a coding agent. Use the tools.", "## Return of functions.grep:0\n"] * 20
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=list(KIMI_SPECIAL_IDS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    tok.save(str(folder / "tokenizer.json"))
    special_ids = {t: tok.token_to_id(t) for t in KIMI_SPECIAL_IDS}
    config = {"bos_token": "[BOS]", "eos_token": "[EOS]", "pad_token": "[PAD]",
              "added_tokens_decoder": added_tokens_decoder(special_ids)}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    shutil.copy(TEMPLATE_PATH, folder / "chat_template.jinja")
    (folder / "tokenization_kimi.py").write_text(POISON_MODULE)
    return folder


@pytest.fixture(scope="session")
def kimi_tokenizer(kimi_tiktoken_dir):
    from kimi_nvfp4.data.tokenizer import load_tokenizer

    return load_tokenizer(kimi_tiktoken_dir)


@pytest.fixture(scope="session")
def hf_tokenizer(hf_tokenizer_dir):
    from kimi_nvfp4.data.tokenizer import load_tokenizer

    return load_tokenizer(hf_tokenizer_dir)


def tool_call_conversation_record() -> dict:
    """A small agent session in OpenAI format with tools, a tool call, its result and thinking."""
    tools = [{"type": "function", "function": {"name": "grep", "description": "Search the repo.",
                                               "parameters": {"type": "object", "required": ["pattern"],
                                                              "properties": {"pattern": {"type": "string"}}}}}]
    return {
        "messages": [
            {"role": "system", "content": "You are a coding agent."},
            {"role": "user", "content": "Where is scanstring used?"},
            {"role": "assistant", "content": None, "reasoning_content": "Search first.",
             "tool_calls": [{"id": "functions.grep:0", "type": "function",
                             "function": {"name": "grep", "arguments": "{\"pattern\": \"scanstring\"}"}}]},
            {"role": "tool", "tool_call_id": "functions.grep:0", "name": "grep",
             "content": "json/decoder.py:130:scanstring = c_scanstring or py_scanstring"},
            {"role": "assistant", "content": "It is bound at json/decoder.py:130.", "reasoning_content": "Done."},
        ],
        "tools": tools,
    }


@pytest.fixture
def tool_call_record() -> dict:
    return tool_call_conversation_record()


@pytest.fixture
def kimi_special_ids() -> dict[str, int]:
    return dict(KIMI_SPECIAL_IDS)


@pytest.fixture
def make_kimi_tokenizer_folder():
    """Factory: make_kimi_tokenizer_folder(folder, num_ranks, special_ids) -> folder."""
    return write_kimi_tokenizer_folder
