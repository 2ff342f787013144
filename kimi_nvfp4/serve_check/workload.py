"""Coding-agent sessions for the closed-loop load: real source files as tool results.

Shape (SPEC §5): each request carries the whole history plus one new tool result; prompts grow
from `input_tokens/2` to about `1.5 * input_tokens` (mean ≈ `input_tokens`), replies are
`output_tokens` long. Text is sized in characters through `chars_per_token`; the server's usage
reports the real token counts, which are what the metrics use.
"""

from __future__ import annotations

import json
import random
import sysconfig
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..errors import KimiNvfp4Error

DEFAULT_CONCURRENCY = (1, 2, 4, 6, 8, 16, 32)
CONTEXT_SAFETY_FRACTION = 0.9  # leave room for the chat template's own tokens
MIN_SOURCE_FILE_CHARS = 2000
SYSTEM_PROMPT = (
    "You are a coding agent working in a Python repository. Read files with the read_file tool, "
    "reason about the code, and propose minimal, tested changes. Keep answers short."
)
READ_FILE_TOOL = {
    "type": "function",
    "function": {
        "name": "read_file",
        "description": "Return the text of a file in the repository.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
    },
}


class LoadTooLarge(KimiNvfp4Error):
    """The requested serve-check work does not fit the server (its context, or its speed)."""


class LoadConfig(BaseModel):
    """Closed-loop agent load. Every loop is bounded: sessions x turns requests, and wall-clock limits."""

    model_config = ConfigDict(extra="forbid")

    concurrency: list[int] = Field(default_factory=lambda: list(DEFAULT_CONCURRENCY))
    sessions_per_user: int = Field(1, ge=1, description="sessions each concurrent user runs, one after another")
    turns: int = Field(30, ge=1, description="requests per session")
    input_tokens: int = Field(100_000, ge=16, description="mean prompt tokens per request")
    output_tokens: int = Field(500, ge=1, description="generated tokens per request (ignore_eos)")
    tool_gap_s: float = Field(0.5, ge=0.0, description="pause between a reply and the next request")
    chars_per_token: float = Field(3.5, gt=0.0)
    point_timeout_s: float = Field(1800.0, gt=0.0, description="wall-clock limit per concurrency point")
    request_timeout_s: float = Field(600.0, gt=0.0)
    scale_to_context: bool = Field(True, description="shrink input_tokens so the last turn fits the context")
    num_gpus: int | None = Field(None, ge=1, description="GPUs serving the model (default: profile TP, else 1)")
    seed: int = 0

    @model_validator(mode="after")
    def _check(self) -> LoadConfig:
        if not self.concurrency or any(c < 1 for c in self.concurrency):
            raise ValueError(f"concurrency levels must be >= 1, got {self.concurrency}")
        self.concurrency = sorted(set(self.concurrency))
        return self

    @classmethod
    def quick(cls, **overrides) -> LoadConfig:
        """Small enough for the demo model on CPU: a minute or two in all."""
        base = dict(concurrency=[1, 2, 4], turns=4, input_tokens=256, output_tokens=16, tool_gap_s=0.0,
                    point_timeout_s=120.0, request_timeout_s=60.0)
        return cls(**{**base, **overrides})


@dataclass(frozen=True)
class SessionShape:
    first_context_tokens: int
    tool_result_tokens: int
    output_tokens: int
    turns: int

    @property
    def last_prompt_tokens(self) -> int:
        return self.first_context_tokens + (self.turns - 1) * (self.tool_result_tokens + self.output_tokens)


def session_shape(cfg: LoadConfig, context_length: int | None) -> SessionShape:
    """The per-turn sizes; scaled down (all inputs by one factor) when the last turn would not fit."""
    first, tool = cfg.input_tokens // 2, max(1, cfg.input_tokens // cfg.turns)
    shape = SessionShape(first, tool, cfg.output_tokens, cfg.turns)
    if context_length and cfg.scale_to_context:
        budget = int(context_length * CONTEXT_SAFETY_FRACTION) - cfg.output_tokens
        outputs = (cfg.turns - 1) * cfg.output_tokens
        if shape.last_prompt_tokens > budget:
            room = budget - outputs
            if room < cfg.turns + 1:
                raise LoadTooLarge(
                    f"{cfg.turns} turns of {cfg.output_tokens} output tokens do not fit the server's context of "
                    f"{context_length} tokens; use fewer --turns or --output-tokens (or --quick)")
            scale = room / (first + (cfg.turns - 1) * tool)
            shape = SessionShape(max(1, int(first * scale)), max(1, int(tool * scale)), cfg.output_tokens, cfg.turns)
    return shape


@lru_cache(maxsize=1)
def _source_files() -> tuple[Path, ...]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in sorted(root.glob("*.py")) if p.stat().st_size >= MIN_SOURCE_FILE_CHARS]
    if not files:
        raise FileNotFoundError(f"no Python sources under {root} to build agent sessions from")
    return tuple(files)


class SourceText:
    """Deterministic stream of real source text (Python's standard library) for tool results."""

    def __init__(self, seed: int):
        self._rng = random.Random(seed)
        self._files = _source_files()

    def take(self, chars: int) -> tuple[str, str]:
        """(path, text of about `chars` characters) from a randomly chosen file, wrapping around files."""
        path = self._files[self._rng.randrange(len(self._files))]
        parts, total, p = [], 0, path
        while total < chars:
            text = p.read_text(errors="replace")
            start = self._rng.randrange(max(1, len(text) - chars)) if len(text) > chars else 0
            piece = text[start:start + chars - total]
            parts.append(piece)
            total += len(piece)
            p = self._files[self._rng.randrange(len(self._files))]
        return path.name, "".join(parts)


class AgentSession:
    """One session's growing message history: system, task, then (assistant reply + tool result) per turn."""

    def __init__(self, shape: SessionShape, chars_per_token: float, seed: int, session_id: str):
        self.shape = shape
        self._chars_per_token = chars_per_token
        self._source = SourceText(seed)
        path, context = self._source.take(self._chars(shape.first_context_tokens))
        self.messages: list[dict] = [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": f"[session {session_id}] Review {path} and fix the failing test.\n\n{context}"},
        ]
        self.turn = 0

    def _chars(self, tokens: int) -> int:
        return max(1, int(tokens * self._chars_per_token))

    def observe_prompt_tokens(self, prompt_tokens: int) -> None:
        """Re-estimate characters per token from the server's count for the history just sent, so
        later tool results hit their token sizes with whatever tokenizer the server uses."""
        chars = sum(len(str(m.get("content") or "")) for m in self.messages)
        if prompt_tokens > 0 and chars > 0:
            self._chars_per_token = chars / prompt_tokens

    def add_reply_and_tool_result(self, reply: str) -> None:
        """Append the model's reply as a read_file call and the file text as its result (Kimi ids)."""
        path, text = self._source.take(self._chars(self.shape.tool_result_tokens))
        call_id = f"functions.read_file:{self.turn}"
        self.messages.append({"role": "assistant", "content": reply, "tool_calls": [{
            "id": call_id, "type": "function",
            "function": {"name": "read_file", "arguments": json.dumps({"path": path})}}]})
        self.messages.append({"role": "tool", "tool_call_id": call_id, "content": text})
        self.turn += 1
