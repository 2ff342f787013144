"""Kimi K2 assistant output -> OpenAI fields, as SGLang 0.5.23's `kimi_k2` parsers read it.

The reference server answers what SGLang would, so serve-check measures the same thing on both.
Read from SGLang 0.5.23 (the wheel on PyPI; line links below are to the v0.5.23 tag):

Reasoning (`--reasoning-parser kimi_k2`, sglang/srt/parser/reasoning_parser.py, `KimiK2Detector`
on `BaseReasoningFormatDetector._detect_and_parse_impl`, non-streaming):
- the output is reasoning when reasoning is forced or it contains `<think>`; reasoning is forced
  unless the request says `chat_template_kwargs.thinking = false` (serving_chat
  `_get_reasoning_from_request`: Kimi templates default `thinking` to true);
- leading `<think>` tags are dropped; the reasoning ends at the first `</think>` and everything
  after it is content, leading newlines included (nothing is stripped);
- without `</think>`, the reasoning ends at `<|tool_calls_section_begin|>` (anywhere, not only at
  a line start) and the section stays in the content, so its tool calls are still parsed; with
  neither, everything is reasoning (generation stopped while thinking);
- `chat_template_kwargs.force_nonempty_content = true` swaps the two when the content is empty.

Tool calls (`--tool-call-parser kimi_k2`, sglang/srt/function_call/kimik2_detector.py
`detect_and_parse`, serving_chat `_process_tool_calls`):
- parsed only when the request declares tools and `<|tool_calls_section_begin|>` occurs;
- every `<|tool_call_begin|> ID <|tool_call_argument_begin|> {…} <|tool_call_end|>` in the whole
  text is a call (the regex is DOTALL in 0.5.23: arguments may hold raw newlines; whitespace around
  the id and the arguments is allowed; arguments must be brace-delimited text, not checked as JSON);
- the name comes from an id `(functions.)?NAME:N` (NAME of `[\\w.-]`); a bare counter id `N` takes
  the one declared tool, or the tool whose schema properties best match the argument keys; any
  other id skips the call;
- the content is the text before the first section begin, also when no call parsed (the section
  is dropped); `content` is "" rather than null;
- each call's id is re-made as `functions.NAME:K`, K = tool calls already in the request's history
  + the call's position in this reply (the model's own `:N` is ignored); a reply that stopped on
  its stop token with calls finishes with `tool_calls`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

SECTION_BEGIN = "<|tool_calls_section_begin|>"
SECTION_END = "<|tool_calls_section_end|>"
CALL_BEGIN = "<|tool_call_begin|>"
ARGUMENT_BEGIN = "<|tool_call_argument_begin|>"
CALL_END = "<|tool_call_end|>"
THINK_BEGIN = "<think>"
THINK_END = "</think>"

# kimik2_detector.py L71-L74 (v0.5.23): DOTALL, id `[^\s<|]+`, arguments `\{.*?\}`.
_CALL_RE = re.compile(
    r"<\|tool_call_begin\|>\s*(?P<id>[^\s<|]+)\s*<\|tool_call_argument_begin\|>\s*"
    r"(?P<args>\{.*?\})\s*<\|tool_call_end\|>",
    re.DOTALL,
)
# kimik2_detector.py L85-L89: "functions.search:0", "search:0"; and a bare call counter "3".
_ID_RE = re.compile(r"^(?:functions\.)?(?P<name>[\w.\-]+):(?P<index>\d+)$")
_COUNTER_RE = re.compile(r"^\d+$")


@dataclass(frozen=True)
class ParsedToolCall:
    name: str
    arguments: str  # the JSON object text as generated (not re-serialised)
    raw_id: str  # the id the model wrote (SGLang replaces it, see to_openai)

    def to_openai(self, position: int, history_tool_calls: int = 0) -> dict:
        """The OpenAI tool call; its id is SGLang's `functions.NAME:K` (serving_chat._process_tool_call_id)."""
        return {
            "index": position,
            "id": f"functions.{self.name}:{history_tool_calls + position}",
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def split_reasoning(text: str, *, force_reasoning: bool = True,
                    force_nonempty_content: bool = False) -> tuple[str, str]:
    """(reasoning_content, content) of a complete output."""
    reasoning, content = _split_reasoning(text, force_reasoning)
    if force_nonempty_content and not content:
        reasoning, content = content, reasoning
    return reasoning, content


def _split_reasoning(text: str, force_reasoning: bool) -> tuple[str, str]:
    if not (force_reasoning or THINK_BEGIN in text):
        return "", text
    while text.startswith(THINK_BEGIN):
        text = text[len(THINK_BEGIN):]
    if THINK_END not in text:
        section = text.find(SECTION_BEGIN)
        if section != -1:
            return text[:section], text[section:]
        return text, ""
    reasoning, _, content = text.partition(THINK_END)
    return reasoning, content


def _schema_properties(schema: Any) -> dict:
    """Top-level properties, or those of anyOf/oneOf/allOf branches (function_call/utils.py)."""
    if not isinstance(schema, dict):
        return {}
    if isinstance(schema.get("properties"), dict):
        return schema["properties"]
    merged: dict = {}
    for keyword in ("anyOf", "oneOf", "allOf"):
        for branch in schema.get(keyword) or []:
            for key, value in _schema_properties(branch).items():
                merged.setdefault(key, value)
    return merged


def _tool_name(tool: dict) -> str | None:
    return (tool.get("function") or {}).get("name")


def _infer_name(tools: list[dict], arguments: str) -> str | None:
    """A bare-counter id names no tool: the one declared, or the best match of argument keys."""
    if not tools:
        return None
    if len(tools) == 1:
        return _tool_name(tools[0])
    try:
        keys = set(json.loads(arguments).keys())
    except (json.JSONDecodeError, TypeError, AttributeError):
        return None
    best, best_score = None, -1
    for tool in tools:
        props = set(_schema_properties((tool.get("function") or {}).get("parameters") or {}))
        if not props:
            continue
        score = len(keys & props) - len(keys - props)
        if score > best_score:
            best, best_score = _tool_name(tool), score
    return best


def _call_name(call_id: str, tools: list[dict], arguments: str) -> str | None:
    m = _ID_RE.match(call_id)
    if m:
        return m.group("name")
    if _COUNTER_RE.match(call_id):
        return _infer_name(tools, arguments)
    return None


def parse_tool_calls(text: str, tools: list[dict] | None = None) -> tuple[str, list[ParsedToolCall]]:
    """(content, calls) of the text after the reasoning; text without a section is all content."""
    start = text.find(SECTION_BEGIN)
    if start < 0:
        return text, []
    calls = []
    for m in _CALL_RE.finditer(text):
        name = _call_name(m.group("id"), tools or [], m.group("args"))
        if name is not None:
            calls.append(ParsedToolCall(name, m.group("args"), m.group("id")))
    return text[:start], calls


def history_tool_calls(messages: list[dict]) -> int:
    """Tool calls already in a request's assistant messages (serving_chat._get_history_tool_calls_cnt)."""
    return sum(len(m.get("tool_calls") or []) for m in messages if m.get("role") == "assistant")


def reasoning_forced(template_kwargs: dict) -> bool:
    """SGLang forces the kimi_k2 reasoning parser unless the request turns thinking off."""
    return template_kwargs.get("thinking") is not False


@dataclass
class StreamSplitter:
    """Streaming view of the same parsers: feed text deltas, get (reasoning, content) deltas.

    The deltas add up to the non-streaming result; content stops at a tool-call section begin and
    the calls are emitted once at the end (`finish`) from the complete text (clients accumulate
    tool_call deltas either way). Text after a section's end is not streamed (SGLang's streaming
    parser would stream it with the special tokens removed; its non-streaming one drops it).
    """

    force_reasoning: bool = True
    parse_tools: bool = True  # SGLang runs the tool parser only when the request declares tools
    tools: list[dict] | None = None
    force_nonempty_content: bool = False
    text: str = ""
    _emitted_reasoning: int = 0
    _emitted_content: int = 0

    def _views(self, final: bool) -> tuple[str, str]:
        reasoning, content = _split_reasoning(self.text, self.force_reasoning)
        if self.parse_tools:
            content, _ = parse_tool_calls(content, self.tools)
        if final:
            if self.force_nonempty_content and not content:
                reasoning, content = content, reasoning
            return reasoning, content
        if self.force_nonempty_content and not content:
            return "", ""  # which side the text lands on is known only at the end
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
        _, content = _split_reasoning(self.text, self.force_reasoning)
        _, calls = parse_tool_calls(content, self.tools)
        return r, c, calls
