"""Fixtures for serve_check: a scripted engine for HTTP-layer tests and an in-process reference server.

`ScriptedEngine` stands in for the emulator only where the model is beside the point (HTTP shapes,
streaming, usage accounting, load generation, report plumbing). It tokenizes bytes, keeps a real
`PrefixCache` of token-list snapshots, and replies with scripted text or a deterministic filler.
Tests that need the real emulator are in test_emulator_engine.py.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field

import pytest

from kimi_nvfp4.serve_check.engine import EngineStream, SamplingParams, TokenEvent
from kimi_nvfp4.serve_check.prefix_cache import PrefixCache
from kimi_nvfp4.serve_check.reference_server import ReferenceServer

SPECIALS = ["<|im_end|>", "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
            "<|tool_call_argument_begin|>", "<|tool_call_end|>", "<think>", "</think>"]
SPECIAL_BASE = 256
END_ID = SPECIAL_BASE  # <|im_end|>
FILLER = "abcdefghijklmnopqrstuvwxyz "


@dataclass
class TokenListKV:
    """A KV snapshot that is just the token ids it covers (enough for prefix-cache bookkeeping)."""

    tokens: list[int] = field(default_factory=list)

    @property
    def seq_len(self) -> int:
        return len(self.tokens)

    def clone(self) -> TokenListKV:
        return TokenListKV(list(self.tokens))

    def truncate(self, n: int) -> TokenListKV:
        if not 0 <= n <= len(self.tokens):
            raise ValueError("bad truncate")
        self.tokens = self.tokens[:n]
        return self


class ScriptedEngine:
    model_name = "scripted"
    activations = "w4a16"
    model_path = "/scripted"

    vocab_size = SPECIAL_BASE + len(SPECIALS)
    generation_defaults: dict = {}

    def __init__(self, script: dict[str, str] | None = None, context_length: int = 1 << 16,
                 cache_tokens: int = 1 << 20, token_delay_s: float = 0.0):
        self.script = script or {}
        self.context_length = context_length
        self.token_delay_s = token_delay_s  # slow generation down, for queueing and cancellation tests
        self.started = 0  # generations the engine began
        self._cache = PrefixCache(cache_tokens)
        self.forwarded_tokens = 0  # prompt tokens actually "computed" (not served from the cache)

    @property
    def prefix_cache(self):
        return self._cache

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        i = 0
        while i < len(text):
            for k, sp in enumerate(SPECIALS):
                if text.startswith(sp, i):
                    ids.append(SPECIAL_BASE + k)
                    i += len(sp)
                    break
            else:
                ids.extend(text[i].encode())
                i += 1
        return ids

    def decode(self, ids: list[int]) -> str:
        out, buf = [], bytearray()
        for t in ids:
            if t >= SPECIAL_BASE:
                out.append(buf.decode(errors="replace"))
                buf = bytearray()
                out.append(SPECIALS[t - SPECIAL_BASE])
            else:
                buf.append(t)
        out.append(buf.decode(errors="replace"))
        return "".join(out)

    def render_chat(self, messages: list[dict], tools: list[dict] | None, **template_kwargs) -> list[int]:
        self.last_template_kwargs = template_kwargs
        text = "".join(f"[{m['role']}]{m.get('content') or ''}{json.dumps(m.get('tool_calls'))}<|im_end|>"
                       for m in messages)
        if tools:
            text = f"[tools]{json.dumps(tools)}<|im_end|>" + text
        return self.encode(text + "[assistant]")

    def start(self, prompt_ids: list[int], params: SamplingParams, should_stop=None) -> EngineStream:
        matched, snap = self._cache.match(prompt_ids, max_match=len(prompt_ids) - 1)
        stream = EngineStream(cached_tokens=matched, tokens=iter(()))
        stream.tokens = self._run(prompt_ids, matched, params, stream)
        return stream

    def _reply_ids(self, prompt_ids: list[int], n: int) -> list[int]:
        text = self.decode(prompt_ids)
        for key, reply in self.script.items():
            if key in text:
                return self.encode(reply) + [END_ID]
        seed = hashlib.sha256(bytes(t % 256 for t in prompt_ids)).digest()
        return [ord(FILLER[seed[i % len(seed)] % len(FILLER)]) for i in range(n)]

    def _run(self, prompt_ids, matched, params: SamplingParams, stream: EngineStream):
        self.started += 1
        self.forwarded_tokens += len(prompt_ids) - matched
        self._cache.insert(prompt_ids, TokenListKV(list(prompt_ids)))
        reply = self._reply_ids(prompt_ids, params.max_new_tokens)
        if params.ignore_eos:
            reply = [t for t in reply if t != END_ID]
            reply += [ord("x")] * (params.max_new_tokens - len(reply))
        for tok in reply[: params.max_new_tokens]:
            if self.token_delay_s:
                time.sleep(self.token_delay_s)
            stream.output_ids.append(tok)
            if tok == END_ID and not params.ignore_eos:
                stream.finish_reason = "stop"
                yield TokenEvent(tok, -0.5, is_stop=True)
                return
            yield TokenEvent(tok, -0.5)


@pytest.fixture
def scripted_server():
    """Factory: `url, engine = scripted_server(script={...})`; servers stop at teardown."""
    servers = []

    def start(app_options: dict | None = None, **kw):
        engine = ScriptedEngine(**kw)
        server = ReferenceServer(engine, **(app_options or {}))
        url = server.start()
        servers.append(server)
        return url, engine

    yield start
    for s in servers:
        s.stop()
