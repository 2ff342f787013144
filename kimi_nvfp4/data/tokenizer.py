"""Load a checkpoint's tokenizer without running any code shipped inside the checkpoint (docs/formats.md §1).

Kimi K2.x ships `tiktoken.model` + `tokenization_kimi.py` (remote code) + `tokenizer_config.json`.
We never import that .py file: the few facts it encodes (the pre-tokenizer regex, 256 special
slots numbered from the BPE vocabulary size, `<|reserved_token_N|>` names for unnamed slots, the
chunking that keeps tiktoken from panicking) are re-implemented here and cited. Everything else
(ranks, special-token names and ids, the chat template) is read from the checkpoint's data files.

The bundled tiny demo model uses a `tokenizer.json` (HF `tokenizers`) with the same special
tokens, so both backends sit behind one `KimiTokenizer`.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
from pathlib import Path
from typing import Any, Iterator, Mapping, Protocol, Sequence

import tiktoken

from ..errors import CheckpointError
from .chat_template import TOKENIZER_CONFIG_FILE, ChatTemplate, deep_sort_keys, find_chat_template
from .tool_declaration import ToolSchemaError, encode_tools_typescript

log = logging.getLogger(__name__)

TIKTOKEN_MODEL_FILE = "tiktoken.model"
TOKENIZER_JSON_FILE = "tokenizer.json"
GENERATION_CONFIG_FILE = "generation_config.json"

# Pre-tokenizer regex, from moonshotai's tokenization_kimi.py `TikTokenTokenizer.pat_str`
# (identical in Kimi-K2-Instruct, K2-Thinking and K2.5): Han runs, cased words with English
# contractions, 1-3 digit groups, punctuation runs, newlines, whitespace.
KIMI_PAT_STR = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)
# tokenization_kimi.py `num_reserved_special_tokens`: special ids are len(ranks) .. len(ranks)+255
# (163584 .. 163839 for K2, so vocab 163840).
NUM_RESERVED_SPECIAL_TOKENS = 256
RESERVED_TOKEN_NAME = "<|reserved_token_{}|>"
# tiktoken panics on very long inputs and on very long runs of (non-)whitespace
# (https://github.com/openai/tiktoken/issues/195); Kimi's tokenizer encodes in chunks of these sizes.
TIKTOKEN_MAX_ENCODE_CHARS = 400_000
TIKTOKEN_MAX_RUN_CHARS = 25_000
# Kimi's defaults when tokenizer_config names none (tokenization_kimi.py __init__ defaults).
DEFAULT_BOS_TOKEN = "[BOS]"
DEFAULT_EOS_TOKEN = "[EOS]"
# End of a chat turn: the token generation stops on in a chat (docs/formats.md §1).
END_OF_TURN_TOKEN = "<|im_end|>"
_SPECIAL_TOKEN_ATTRIBUTES = ("bos_token", "eos_token", "unk_token", "pad_token")


class _Backend(Protocol):
    vocab_size: int

    def encode(self, text: str, allow_special: bool) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def decode_bytes(self, ids: Sequence[int]) -> bytes: ...


def _read_json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"not valid JSON ({e})", file=path) from e
    if not isinstance(data, dict):
        raise CheckpointError(f"expected a JSON object, got {type(data).__name__}", file=path)
    return data


def _token_content(value: Any) -> str | None:
    """tokenizer_config stores a token as a string or as a serialized AddedToken {"content": ...}."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def named_special_tokens(tokenizer_config: Mapping[str, Any] | None, config_path: Path) -> dict[int, str]:
    """`added_tokens_decoder` as {id: content}, validated."""
    decoder = (tokenizer_config or {}).get("added_tokens_decoder") or {}
    if not isinstance(decoder, Mapping):
        raise CheckpointError("added_tokens_decoder must be an object {id: {content: ...}}", file=config_path)
    named: dict[int, str] = {}
    for key, entry in decoder.items():
        content = _token_content(entry)
        try:
            token_id = int(key)
        except ValueError:
            token_id = -1
        if token_id < 0 or content is None:
            raise CheckpointError(f"added_tokens_decoder entry {key!r} must map an integer id to {{content: str}}",
                                  file=config_path)
        named[token_id] = content
    return named


def read_tiktoken_ranks(path: Path) -> dict[bytes, int]:
    """Parse a tiktoken BPE file (`base64-token rank` per line), the format `tiktoken.load.load_tiktoken_bpe` reads.

    We parse it ourselves instead of calling `load_tiktoken_bpe`, because that goes through
    `read_file_cached`, which caches by the *path's* hash in a shared temp dir and would return a
    stale vocabulary when a file at the same path changes. Errors name the line.
    """
    ranks: dict[bytes, int] = {}
    try:
        text = path.read_text(encoding="ascii")
    except UnicodeDecodeError as e:
        raise CheckpointError("expected ASCII lines 'base64-token rank'", file=path) from e
    for line_no, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        parts = line.split()
        try:
            if len(parts) != 2:
                raise ValueError
            token, rank = base64.b64decode(parts[0], validate=True), int(parts[1])
        except (ValueError, binascii.Error) as e:
            raise CheckpointError(f"line {line_no}: expected 'base64-token rank', got {line[:60]!r}", file=path) from e
        if token in ranks:
            raise CheckpointError(f"line {line_no}: token {token!r} listed twice", file=path)
        ranks[token] = rank
    if not ranks:
        raise CheckpointError("no BPE ranks", file=path)
    if sorted(ranks.values()) != list(range(len(ranks))):
        # Kimi numbers special tokens from len(ranks); gaps or duplicates would shift every special id.
        raise CheckpointError(f"ranks must be exactly 0..{len(ranks) - 1} with no gaps or repeats", file=path)
    return ranks


def kimi_special_tokens(num_base_tokens: int, named: Mapping[int, str], config_path: Path) -> dict[str, int]:
    """Special tokens as tokenization_kimi.py builds them: every id in the reserved block, named from
    `added_tokens_decoder` or `<|reserved_token_N|>`; named ids beyond the block are kept as well."""
    specials: dict[str, int] = {}
    block = range(num_base_tokens, num_base_tokens + NUM_RESERVED_SPECIAL_TOKENS)
    for token_id in sorted(set(block) | set(named)):
        if token_id < num_base_tokens:
            raise CheckpointError(f"added token id {token_id} ({named[token_id]!r}) collides with a BPE rank "
                                  f"(base vocabulary is 0..{num_base_tokens - 1})", file=config_path)
        name = named.get(token_id, RESERVED_TOKEN_NAME.format(token_id))
        if name in specials:
            raise CheckpointError(f"special token {name!r} has two ids ({specials[name]}, {token_id})",
                                  file=config_path)
        specials[name] = token_id
    return specials


def _split_long_runs(text: str, max_run: int) -> Iterator[str]:
    """Cut `text` so no piece has a run of more than `max_run` whitespace or non-whitespace chars."""
    start = 0
    run_len = 0
    run_is_space: bool | None = None
    for i, ch in enumerate(text):
        is_space = ch.isspace()
        if is_space == run_is_space:
            run_len += 1
            if run_len > max_run:
                yield text[start:i]
                start, run_len = i, 1
        else:
            run_is_space, run_len = is_space, 1
    yield text[start:]


class _TiktokenBackend:
    def __init__(self, model_path: Path, ranks: dict[bytes, int], specials: dict[str, int]):
        try:
            self.encoding = tiktoken.Encoding(name=model_path.name, pat_str=KIMI_PAT_STR,
                                              mergeable_ranks=ranks, special_tokens=specials)
        except ValueError as e:
            raise CheckpointError(f"tiktoken rejected the vocabulary: {e}", file=model_path) from e
        self.vocab_size = self.encoding.n_vocab

    def encode(self, text: str, allow_special: bool) -> list[int]:
        ids: list[int] = []
        for i in range(0, len(text), TIKTOKEN_MAX_ENCODE_CHARS):
            for piece in _split_long_runs(text[i:i + TIKTOKEN_MAX_ENCODE_CHARS], TIKTOKEN_MAX_RUN_CHARS):
                if allow_special:
                    ids.extend(self.encoding.encode(piece, allowed_special="all"))
                else:
                    ids.extend(self.encoding.encode(piece, allowed_special=set(), disallowed_special=()))
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.encoding.decode(list(ids), errors="replace")

    def decode_bytes(self, ids: Sequence[int]) -> bytes:
        return self.encoding.decode_bytes(list(ids))


class _HFTokenizersBackend:
    def __init__(self, path: Path):
        from tokenizers import Tokenizer

        try:
            self.tokenizer = Tokenizer.from_file(str(path))
            # A second instance that treats special-token text as plain text (allow_special=False).
            self.plain = Tokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception on malformed files
            raise CheckpointError(f"not a valid tokenizers file ({e})", file=path) from e
        self.plain.encode_special_tokens = True
        self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)

    def added_tokens(self) -> dict[int, str]:
        return {i: t.content for i, t in self.tokenizer.get_added_tokens_decoder().items()}

    def encode(self, text: str, allow_special: bool) -> list[int]:
        tok = self.tokenizer if allow_special else self.plain
        # No BOS/EOS post-processing: the chat template writes every special token itself.
        return tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def decode_bytes(self, ids: Sequence[int]) -> bytes:
        # tokenizers decodes to str only; a token holding part of a UTF-8 character comes back as U+FFFD.
        return self.decode(ids).encode("utf-8")


class KimiTokenizer:
    """Encode/decode and chat rendering for a Kimi K2.x (or the tiny demo) checkpoint."""

    def __init__(self, *, backend: _Backend, kind: str, special_ids: dict[str, int],
                 special_tokens: dict[str, str], chat_template: ChatTemplate | None,
                 stop_ids: tuple[int, ...], path: Path):
        self._backend = backend
        self.kind = kind  # "tiktoken" (Kimi) or "tokenizers" (tokenizer.json)
        self.special_ids = special_ids
        self.special_tokens = special_tokens  # bos_token/eos_token/... -> text, passed to the template
        self.chat_template = chat_template
        self.stop_ids = stop_ids
        self.path = path
        self._special_id_set = frozenset(special_ids.values())
        eos = special_tokens.get("eos_token", DEFAULT_EOS_TOKEN)
        if eos not in special_ids:
            raise CheckpointError(f"eos_token {eos!r} is not a special token of this tokenizer", file=path)
        self.eos_id = special_ids[eos]
        bos = special_tokens.get("bos_token")
        self.bos_id = special_ids.get(bos) if bos else None
        pad = special_tokens.get("pad_token")
        self.pad_id = special_ids.get(pad) if pad else None

    @property
    def vocab_size(self) -> int:
        return self._backend.vocab_size

    def encode(self, text: str, allow_special: bool = True) -> list[int]:
        """Token ids of `text`; with allow_special, special-token text becomes its single id."""
        return self._backend.encode(text, allow_special)

    def decode(self, ids: Sequence[int]) -> str:
        return self._backend.decode([int(i) for i in ids])

    def decode_bytes(self, ids: Sequence[int]) -> bytes:
        """The raw bytes of `ids` (a token may end inside a UTF-8 character)."""
        return self._backend.decode_bytes([int(i) for i in ids])

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_id_set

    def apply_chat_template(self, messages: Sequence[Any], tools: Sequence[Mapping[str, Any]] | None = None,
                            add_generation_prompt: bool = True, **template_kwargs: Any) -> str:
        """Render OpenAI-format messages (dicts or pydantic `Message`s) with the checkpoint's template.

        Does what Kimi K2.5's `TikTokenTokenizer.apply_chat_template` adds around transformers'
        rendering (tokenization_kimi.py), without running it: tool schemas get their keys sorted
        (`deep_sort_dict`), are also passed as the TypeScript declaration `tools_ts_str`
        (tool_declaration.py; omitted, so the template uses JSON, if a schema is outside that
        format), and `thinking=True`, `preserve_thinking=False` are the defaults. Other keyword
        arguments are template variables.
        """
        if self.chat_template is None:
            raise CheckpointError("no chat template (expected chat_template.jinja or tokenizer_config "
                                  "'chat_template')", file=self.path)
        dicts = [m.model_dump(mode="json", exclude_none=True) if hasattr(m, "model_dump") else m for m in messages]
        sorted_tools = deep_sort_keys([dict(t) for t in tools]) if tools else None
        if sorted_tools and "tools_ts_str" not in template_kwargs:
            try:
                template_kwargs["tools_ts_str"] = encode_tools_typescript(sorted_tools)
            except ToolSchemaError as e:
                log.warning("tools not expressible as a TypeScript declaration (%s); the template gets JSON", e)
        template_kwargs.setdefault("thinking", True)
        template_kwargs.setdefault("preserve_thinking", False)
        return self.chat_template.render(dicts, tools=sorted_tools, add_generation_prompt=add_generation_prompt,
                                         special_tokens=self.special_tokens, **template_kwargs)

    def encode_chat(self, messages: Sequence[Any], tools: Sequence[Mapping[str, Any]] | None = None,
                    add_generation_prompt: bool = True, **template_kwargs: Any) -> list[int]:
        """`encode(apply_chat_template(...))` with special tokens allowed."""
        text = self.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                        **template_kwargs)
        return self.encode(text, allow_special=True)

    def __repr__(self) -> str:
        return f"KimiTokenizer({self.kind}, vocab={self.vocab_size}, path={str(self.path)!r})"


def _special_token_texts(tokenizer_config: Mapping[str, Any] | None, config_path: Path) -> dict[str, str]:
    texts: dict[str, str] = {}
    for attr in _SPECIAL_TOKEN_ATTRIBUTES:
        value = (tokenizer_config or {}).get(attr)
        content = _token_content(value)
        if value is not None and content is None:
            raise CheckpointError(f"{attr} must be a string or {{content: str}}", file=config_path)
        if content is not None:
            texts[attr] = content
    return texts


def _stop_ids(checkpoint_dir: Path, special_ids: Mapping[str, int], eos_token: str) -> tuple[int, ...]:
    ids = {special_ids[eos_token]} if eos_token in special_ids else set()
    if END_OF_TURN_TOKEN in special_ids:
        ids.add(special_ids[END_OF_TURN_TOKEN])
    gen_path = checkpoint_dir / GENERATION_CONFIG_FILE
    gen = _read_json(gen_path) or {}
    eos = gen.get("eos_token_id")
    for value in (eos if isinstance(eos, list) else [eos]):
        if value is None:
            continue
        if not isinstance(value, int):
            raise CheckpointError(f"eos_token_id must be an int or a list of ints, got {value!r}", file=gen_path)
        ids.add(value)
    return tuple(sorted(ids))


def load_tokenizer(checkpoint_dir: str | Path) -> KimiTokenizer:
    """The tokenizer of a checkpoint folder: `tiktoken.model` (Kimi) or `tokenizer.json` (tiny demo).

    Reads only data files (tiktoken.model / tokenizer.json, tokenizer_config.json,
    chat_template.jinja, generation_config.json); never imports the folder's .py files.
    """
    root = Path(checkpoint_dir)
    if not root.is_dir():
        raise CheckpointError("expected a checkpoint folder", file=root)
    config_path = root / TOKENIZER_CONFIG_FILE
    tokenizer_config = _read_json(config_path)
    named = named_special_tokens(tokenizer_config, config_path)
    special_tokens = _special_token_texts(tokenizer_config, config_path)

    backend: _Backend
    if (root / TIKTOKEN_MODEL_FILE).is_file():
        special_tokens.setdefault("bos_token", DEFAULT_BOS_TOKEN)
        special_tokens.setdefault("eos_token", DEFAULT_EOS_TOKEN)
        model_path = root / TIKTOKEN_MODEL_FILE
        ranks = read_tiktoken_ranks(model_path)
        special_ids = kimi_special_tokens(len(ranks), named, config_path)
        backend = _TiktokenBackend(model_path, ranks, special_ids)
        kind = "tiktoken"
    elif (root / TOKENIZER_JSON_FILE).is_file():
        hf = _HFTokenizersBackend(root / TOKENIZER_JSON_FILE)
        added = hf.added_tokens()
        for token_id, content in named.items():
            if added.get(token_id, content) != content:
                raise CheckpointError(f"added_tokens_decoder says id {token_id} is {content!r} but tokenizer.json "
                                      f"has {added[token_id]!r}", file=config_path)
        special_ids = {content: token_id for token_id, content in sorted({**added, **named}.items())}
        backend, kind = hf, "tokenizers"
    else:
        raise CheckpointError(f"no tokenizer: expected {TIKTOKEN_MODEL_FILE} or {TOKENIZER_JSON_FILE}", file=root)

    eos_token = special_tokens.get("eos_token", DEFAULT_EOS_TOKEN)
    return KimiTokenizer(
        backend=backend, kind=kind, special_ids=special_ids, special_tokens=special_tokens,
        chat_template=find_chat_template(root, tokenizer_config),
        stop_ids=_stop_ids(root, special_ids, eos_token), path=root,
    )
