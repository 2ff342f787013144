"""Kimi K2 assistant output -> OpenAI fields, with the semantics of SGLang's `kimi_k2` parsers.

Tool calls (sglang/srt/function_call/kimik2_detector.py, `detect_and_parse`):
    <|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{json}
    <|tool_call_end|>...<|tool_calls_section_end|>
content is the text before the section; each call's id is `functions.NAME:IDX`; an id that does not
match `(functions.)?NAME:IDX` is skipped; arguments are the JSON object text as generated (not
re-serialised, so a client sees exactly what the model wrote).
Reasoning (`--reasoning-parser kimi_k2`): text inside <think>...</think> becomes reasoning_content.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

SECTION_BEGIN = "<|tool_calls_section_begin|>"
SECTION_END = "<|tool_calls_section_end|>"
CALL_BEGIN = "<|tool_call_begin|>"
ARGUMENT_BEGIN = "<|tool_call_argument_begin|>"
CALL_END = "<|tool_call_end|>"
THINK_BEGIN = "<think>"
THINK_END = "</think>"

_CALL_RE = re.compile(
    r"<\|tool_call_begin\|>\s*(?P<id>[\w\.]+:\d+)\s*<\|tool_call_argument_begin\|>\s*"
    r"(?P<args>\{.*?\})\s*<\|tool_call_end\|>",
    re.DOTALL,
)
_ID_RE = re.compile(r"^(?:functions\.)?(?P<name>[\w\.]+):(?P<index>\d+)$")


@dataclass(frozen=True)
class ParsedToolCall:
    id: str
    name: str
    index: int
    arguments: str  # JSON text as generated

    def to_openai(self, position: int) -> dict:
        return {
            "index": position,
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def parse_tool_calls(text: str) -> tuple[str, list[ParsedToolCall]]:
    """(content before the tool-call section, parsed calls); text without a section is all content."""
    start = text.find(SECTION_BEGIN)
    if start < 0:
        return text, []
    calls = []
    for m in _CALL_RE.finditer(text, start):
        idm = _ID_RE.match(m.group("id"))
        if idm is None:
            continue  # kimik2_detector logs and skips malformed ids
        calls.append(ParsedToolCall(m.group("id"), idm.group("name"), int(idm.group("index")), m.group("args")))
    return text[:start], calls


def split_reasoning(text: str, *, in_reasoning: bool = False) -> tuple[str, str]:
    """(reasoning_content, content). `in_reasoning` when the prompt already opened <think>."""
    if text.startswith(THINK_BEGIN):
        text, in_reasoning = text[len(THINK_BEGIN):], True
    if not in_reasoning:
        return "", text
    reasoning, sep, rest = text.partition(THINK_END)
    if not sep:  # still thinking when generation stopped
        return reasoning, ""
    return reasoning, rest.lstrip("\n")


@dataclass
class StreamSplitter:
    """Streaming view of the same parsers: feed text deltas, get (reasoning, content) deltas.

    Content stops at a tool-call section begin; the calls themselves are emitted once at the end
    (`finish`) from the complete text — clients accumulate tool_call deltas either way.
    """

    in_reasoning: bool = False
    parse_tools: bool = True  # SGLang runs the tool parser only when the request declares tools
    text: str = ""
    _emitted_reasoning: int = 0
    _emitted_content: int = 0

    def _views(self, final: bool) -> tuple[str, str]:
        reasoning, content = split_reasoning(self.text, in_reasoning=self.in_reasoning)
        if self.parse_tools:
            content, _ = parse_tool_calls(content)
        if not final:
            # hold back anything that could be the start of a marker still arriving
            markers = (SECTION_BEGIN, THINK_END, THINK_BEGIN) if self.parse_tools else (THINK_END, THINK_BEGIN)
            for marker in markers:
                for k in range(len(marker) - 1, 0, -1):
                    if content.endswith(marker[:k]):
                        content = content[:-k]
                        break
                    if reasoning.endswith(marker[:k]) and not content:
                        reasoning = reasoning[:-k]
                        break
        return reasoning, content

    def feed(self, delta: str) -> tuple[str, str]:
        self.text += delta
        return self._take(final=False)

    def _take(self, final: bool) -> tuple[str, str]:
        reasoning, content = self._views(final)
        r = reasoning[self._emitted_reasoning:] if len(reasoning) > self._emitted_reasoning else ""
        c = content[self._emitted_content:] if len(content) > self._emitted_content else ""
        self._emitted_reasoning = max(self._emitted_reasoning, len(reasoning))
        self._emitted_content = max(self._emitted_content, len(content))
        return r, c

    def finish(self) -> tuple[str, str, list[ParsedToolCall]]:
        r, c = self._take(final=True)
        if not self.parse_tools:
            return r, c, []
        _, content = split_reasoning(self.text, in_reasoning=self.in_reasoning)
        _, calls = parse_tool_calls(content)
        return r, c, calls
