"""Agent-style chats built from real stdlib files, so the tiny model sees Kimi's chat format.

Three kinds of session, all grounded in a real file (its real definitions, line numbers and text):
- locate:  the user asks where a function is defined; the assistant thinks, calls `grep`, reads the
           real `path:line:text` result and answers with the definition's first lines;
- read:    the assistant calls `read_file` on a line range and explains what it read;
- write:   no tools; the assistant answers with the function's source in a code block.
Sessions are OpenAI-format message lists rendered through the Kimi chat template.
"""

from __future__ import annotations

import ast
import json
import random
import warnings
from dataclasses import dataclass
from typing import Any, Sequence

from .chat_template import render_chat
from .corpus import SourceFile

AGENT_TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {
        "name": "grep", "description": "Search files for a regular expression.",
        "parameters": {"type": "object", "properties": {
            "pattern": {"type": "string"}, "path": {"type": "string"}}, "required": ["pattern", "path"]}}},
    {"type": "function", "function": {
        "name": "read_file", "description": "Read a range of lines from a file.",
        "parameters": {"type": "object", "properties": {
            "path": {"type": "string"}, "start_line": {"type": "integer"}, "end_line": {"type": "integer"}},
            "required": ["path"]}}},
]
MAX_SNIPPET_LINES = 24
READ_WINDOW_LINES = 16


@dataclass(frozen=True)
class _Definition:
    name: str
    lineno: int
    end_lineno: int


def _definitions(source: SourceFile) -> list[_Definition]:
    try:
        with warnings.catch_warnings():  # stdlib tests hold deliberately odd escapes
            warnings.simplefilter("ignore", SyntaxWarning)
            tree = ast.parse(source.text)
    except (SyntaxError, ValueError, RecursionError):
        return []
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.end_lineno:
            out.append(_Definition(node.name, node.lineno, node.end_lineno))
    out.sort(key=lambda d: d.lineno)
    return out


def _lines(source: SourceFile, start: int, end: int) -> str:
    return "\n".join(source.text.splitlines()[start - 1 : end])


def _tool_call(name: str, index: int, arguments: dict[str, Any]) -> dict[str, Any]:
    # Kimi's tool-call ids are `functions.NAME:IDX` (docs/formats.md §1); the template writes the id verbatim.
    return {"id": f"functions.{name}:{index}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments)}}


def _locate_session(src: SourceFile, d: _Definition) -> list[dict[str, Any]]:
    kind = "class" if _lines(src, d.lineno, d.lineno).lstrip().startswith("class") else "def"
    call = _tool_call("grep", 0, {"pattern": f"{kind} {d.name}\\b", "path": src.relpath})
    head = _lines(src, d.lineno, min(d.end_lineno, d.lineno + MAX_SNIPPET_LINES - 1))
    return [
        {"role": "user", "content": f"Where is `{d.name}` defined in `{src.relpath}`?"},
        {"role": "assistant", "content": "", "reasoning_content": f"I should search {src.relpath} for the {kind}.",
         "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"],
         "content": f"{src.relpath}:{d.lineno}:{_lines(src, d.lineno, d.lineno)}"},
        {"role": "assistant", "content": f"`{d.name}` is defined at line {d.lineno} of `{src.relpath}`:\n"
                                         f"```python\n{head}\n```"},
    ]


def _read_session(src: SourceFile, d: _Definition) -> list[dict[str, Any]]:
    start, end = d.lineno, d.lineno + READ_WINDOW_LINES - 1
    call = _tool_call("read_file", 0, {"path": src.relpath, "start_line": start, "end_line": end})
    window = _lines(src, start, end)
    numbered = "\n".join(f"{start + i:>5}\t{line}" for i, line in enumerate(window.splitlines()))
    return [
        {"role": "user", "content": f"Open `{src.relpath}` at line {start} and tell me what is there."},
        {"role": "assistant", "content": "", "reasoning_content": "Let me read those lines.", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": numbered},
        {"role": "assistant", "content": f"Line {start} starts `{d.name}`:\n```python\n{window}\n```"},
    ]


def _write_session(src: SourceFile, d: _Definition) -> list[dict[str, Any]]:
    body = _lines(src, d.lineno, min(d.end_lineno, d.lineno + MAX_SNIPPET_LINES - 1))
    module = src.relpath.removesuffix(".py").replace("/", ".")
    return [
        {"role": "user", "content": f"Write `{d.name}` as it appears in the `{module}` module."},
        {"role": "assistant", "reasoning_content": f"The user wants {module}.{d.name}.",
         "content": f"```python\n{body}\n```"},
    ]


_SESSION_KINDS = (_locate_session, _read_session, _write_session)


def agent_sessions(files: Sequence[SourceFile], n: int, seed: int) -> list[list[dict[str, Any]]]:
    """`n` sessions over definitions drawn (seeded) from `files`."""
    rng = random.Random(seed)
    pool = [(f, d) for f in files for d in _definitions(f)]
    if not pool:
        raise ValueError("no function or class definitions found in the training files")
    return [rng.choice(_SESSION_KINDS)(*rng.choice(pool)) for _ in range(n)]


def render_agent_sessions(files: Sequence[SourceFile], n: int, seed: int) -> list[str]:
    """Sessions rendered for training (tools declared only where a tool is called).

    `preserve_thinking=True`: the model learns every turn's reasoning, as a supervised example of a
    whole session keeps it (a served prompt drops the reasoning of finished turns instead).
    """
    out = []
    for messages in agent_sessions(files, n, seed):
        uses_tools = any(m.get("tool_calls") for m in messages)
        out.append(render_chat(messages, AGENT_TOOLS if uses_tools else None, preserve_thinking=True))
    return out
