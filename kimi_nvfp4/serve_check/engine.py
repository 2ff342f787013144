"""The generation engine behind the reference server: tokenize, prefix-cache, prefill, decode.

`GenerationEngine` is the small interface the HTTP layer needs; `EmulatorEngine` implements it with
the reference K2 model (`kimi_nvfp4.model`) running the NVFP4 checkpoint exactly as the converter
wrote it, and the checkpoint's own tokenizer and chat template (never its Python code).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch

from .prefix_cache import PrefixCache

DEFAULT_PREFIX_CACHE_TOKENS = 1 << 20
# Prompt tokens per forward call (SGLang's --chunked-prefill-size idea): the logits and attention
# scores of one call grow with its length (a 200k-token prompt in one call took gigabytes), and a
# request can be stopped between chunks.
PREFILL_CHUNK_TOKENS = 2048
# DeepSeek-V3/K2 configs always name max_position_embeddings; this is for hand-made ones.
DEFAULT_CONTEXT_LENGTH = 4096
GENERATION_CONFIG_FILE = "generation_config.json"
UNKNOWN_TOKEN_TEXT = "<|unk_{}|>"


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False  # SGLang's extension: always produce max_new_tokens (load tests)


@dataclass(frozen=True)
class TokenEvent:
    token_id: int
    logprob: float
    is_stop: bool = False  # a stop token that ends generation: counted, but not part of the text


@dataclass
class EngineStream:
    """One generation: `cached_tokens` is known before the first token; iterate for tokens."""

    cached_tokens: int
    tokens: Iterator[TokenEvent]
    finish_reason: str = "length"  # set to "stop" by the engine when a stop token ends it
    output_ids: list[int] = field(default_factory=list)

    def __iter__(self) -> Iterator[TokenEvent]:
        return self.tokens


class GenerationEngine(Protocol):
    model_name: str
    activations: str  # what the engine emulates: "w4a4" (Blackwell) or "w4a16" (Hopper Marlin)
    model_path: str
    context_length: int
    vocab_size: int  # token ids a request may send are 0 .. vocab_size - 1
    generation_defaults: dict  # generation_config.json's temperature/top_p, for requests that name none

    def render_chat(self, messages: list[dict], tools: list[dict] | None, **template_kwargs) -> list[int]: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def start(self, prompt_ids: list[int], params: SamplingParams,
              should_stop: Callable[[], bool] | None = None) -> EngineStream: ...

    @property
    def prefix_cache(self) -> PrefixCache | None: ...


def choose_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> TokenEvent:
    """The model's own sampler (greedy when temperature == 0); logprob from the unscaled distribution,
    as SGLang reports it."""
    from ..model.generate import sample_token

    tok = sample_token(logits, params.temperature, params.top_p, generator)
    return TokenEvent(tok, float(torch.log_softmax(logits.float(), dim=-1)[tok]))


def _normalise_messages(messages: list[dict]) -> list[dict]:
    """Chat templates expect tool-call arguments as JSON text or dicts; OpenAI clients send text."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("content") is None:
            m["content"] = ""
        if isinstance(m["content"], list):  # OpenAI content parts: keep the text ones
            m["content"] = "".join(p.get("text", "") for p in m["content"] if isinstance(p, dict))
        out.append(m)
    return out


class EmulatorEngine:
    """The reference emulator as an engine: K2Model on the converted NVFP4 checkpoint, one request at a time."""

    def __init__(
        self,
        checkpoint: str | Path,
        *,
        device: str = "cpu",
        activations: str = "w4a4",
        prefix_cache_tokens: int = DEFAULT_PREFIX_CACHE_TOKENS,
        model_name: str | None = None,
    ):
        from ..data.tokenizer import load_tokenizer
        from ..model.generate import K2Model
        from ..model.weights import open_weights

        self.model_path = str(checkpoint)
        self.model_name = model_name or Path(checkpoint).name
        self.tokenizer = load_tokenizer(checkpoint)
        self.source = open_weights(checkpoint, kind="nvfp4", activations=activations)
        self.model = K2Model(self.source, device=device)
        self.device = device
        self.activations = activations
        text_config = _text_config(checkpoint)
        self.context_length = int(text_config.get("max_position_embeddings", DEFAULT_CONTEXT_LENGTH))
        self.vocab_size = int(text_config.get("vocab_size", self.tokenizer.vocab_size))
        self.generation_defaults = _generation_defaults(checkpoint)
        self.stop_ids = frozenset(self.tokenizer.stop_ids)  # eos, <|im_end|>, generation_config eos
        self._cache: PrefixCache = PrefixCache(prefix_cache_tokens)

    @property
    def prefix_cache(self) -> PrefixCache:
        return self._cache

    def render_chat(self, messages: list[dict], tools: list[dict] | None, **template_kwargs) -> list[int]:
        """`template_kwargs` are the request's `chat_template_kwargs` (e.g. thinking=False), as in SGLang."""
        text = self.tokenizer.apply_chat_template(_normalise_messages(messages), tools=tools,
                                                  add_generation_prompt=True, **template_kwargs)
        return list(self.tokenizer.encode(text, allow_special=True))

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, allow_special=True))

    def decode(self, ids: list[int]) -> str:
        try:
            return self.tokenizer.decode(list(ids))
        except (KeyError, ValueError):
            # the model may emit an id the tokenizer cannot render (vocab padded past the BPE ranks,
            # reserved specials); show it as a marker rather than failing the request
            return "".join(self._decode_one(t) for t in ids)

    def _decode_one(self, token_id: int) -> str:
        try:
            return self.tokenizer.decode([token_id])
        except (KeyError, ValueError):
            return UNKNOWN_TOKEN_TEXT.format(token_id)

    def _forward(self, ids: list[int], cache):
        logits, cache = self.model.forward(torch.tensor(ids, dtype=torch.long), cache=cache)
        return logits.reshape(-1, logits.shape[-1])[-1], cache

    def start(self, prompt_ids: list[int], params: SamplingParams,
              should_stop: Callable[[], bool] | None = None) -> EngineStream:
        """A generation; `should_stop` is asked between prefill chunks (the caller asks between tokens)."""
        if not prompt_ids:
            raise ValueError("empty prompt")
        # at least one prompt token must run through the model to produce the first logits
        matched, cache = self._cache.match(prompt_ids, max_match=len(prompt_ids) - 1)
        stream = EngineStream(cached_tokens=matched, tokens=iter(()))
        stream.tokens = self._run(prompt_ids, matched, cache, params, stream, should_stop or (lambda: False))
        return stream

    def _run(self, prompt_ids, matched, cache, params: SamplingParams, stream: EngineStream,
             should_stop: Callable[[], bool]) -> Iterator[TokenEvent]:
        generator = None
        if params.temperature > 0.0:
            generator = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        for start in range(matched, len(prompt_ids), PREFILL_CHUNK_TOKENS):
            if should_stop():
                stream.finish_reason = "abort"
                return
            logits, cache = self._forward(list(prompt_ids[start:start + PREFILL_CHUNK_TOKENS]), cache)
        # K2Model.forward never mutates a cache it was given, so the snapshot can be shared
        self._cache.insert(prompt_ids, cache)
        out: list[int] = stream.output_ids
        for step in range(params.max_new_tokens):
            ev = choose_token(logits, params, generator)
            out.append(ev.token_id)
            if ev.token_id in self.stop_ids and not params.ignore_eos:
                stream.finish_reason = "stop"
                yield TokenEvent(ev.token_id, ev.logprob, is_stop=True)
                break
            yield ev
            if step + 1 == params.max_new_tokens or len(prompt_ids) + len(out) >= self.context_length:
                break
            logits, cache = self._forward([ev.token_id], cache)
        # SGLang also keeps the generated tokens in the radix tree; the last token was never fed
        if len(out) > 1:
            self._cache.insert(list(prompt_ids) + out[:-1], cache)


def _text_config(checkpoint: str | Path) -> dict:
    cfg = json.loads((Path(checkpoint) / "config.json").read_text())
    return cfg.get("text_config", cfg)


def _generation_defaults(checkpoint: str | Path) -> dict:
    """Sampling defaults from generation_config.json (SGLang reads them for requests that name none)."""
    path = Path(checkpoint) / GENERATION_CONFIG_FILE
    if not path.is_file():
        return {}
    cfg = json.loads(path.read_text())
    return {k: float(cfg[k]) for k in ("temperature", "top_p") if isinstance(cfg.get(k), (int, float))}
