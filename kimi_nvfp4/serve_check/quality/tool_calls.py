"""Tool-call round trips in the Kimi format: the server's kimi_k2 parser must return schema-valid calls.

In the spirit of Moonshot's K2-Vendor-Verifier: for each prompt that clearly asks for a tool, count
whether a call came back (trigger rate), whether its name is one of the declared tools and its
arguments parse as JSON and validate against that tool's JSON schema (schema accuracy).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import jsonschema
from pydantic import BaseModel, ConfigDict

from ..client import ChatClient


def _tool(name: str, description: str, properties: dict, required: list[str], strict: bool = True) -> dict:
    params = {"type": "object", "properties": properties, "required": required}
    if strict:
        params["additionalProperties"] = False
    return {"type": "function", "function": {"name": name, "description": description, "parameters": params}}


@dataclass(frozen=True)
class ToolCallSuite:
    name: str
    tools: list[dict]
    prompts: list[str]


# General tool use: five unrelated tools, strict schemas (enums, minimums, no extra keys).
STANDARD = ToolCallSuite("standard", [
    _tool("read_file", "Read a file from the repository.", {"path": {"type": "string"}}, ["path"]),
    _tool("run_tests", "Run the test suite, optionally one test file.",
          {"path": {"type": "string"}, "verbose": {"type": "boolean"}}, []),
    _tool("grep", "Search the repository for a regular expression.",
          {"pattern": {"type": "string"}, "max_results": {"type": "integer", "minimum": 1}}, ["pattern"]),
    _tool("get_weather", "Current weather for a city.",
          {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, ["city"]),
    _tool("write_file", "Write text to a file, replacing it.",
          {"path": {"type": "string"}, "content": {"type": "string"}}, ["path", "content"]),
], [
    "Open the file src/app/main.py and show me what it does.",
    "Run the tests in tests/test_parser.py verbosely.",
    "Find every place that calls `load_config` in the repository; at most 20 results.",
    "What's the weather in Hanoi right now, in celsius?",
    "Create a file notes/todo.md containing the line '- fix the flaky test'.",
    "Read README.md, please.",
    "Search the code for TODO comments.",
    "Run the whole test suite.",
])

# A coding agent's two everyday tools, asked about real standard-library files. Small models trained
# on agent traffic (the bundled demo model is) can pass this one.
AGENT = ToolCallSuite("agent", [
    _tool("grep", "Search files for a regular expression.",
          {"pattern": {"type": "string"}, "path": {"type": "string"}}, ["pattern", "path"], strict=False),
    _tool("read_file", "Read a range of lines from a file.",
          {"path": {"type": "string"}, "start_line": {"type": "integer"}, "end_line": {"type": "integer"}},
          ["path"], strict=False),
], [
    "Where is `join` defined in `posixpath.py`?",
    "Open `json/decoder.py` at line 40 and tell me what is there.",
    "Where is `dedent` defined in `textwrap.py`?",
    "Open `shlex.py` at line 120 and tell me what is there.",
    "Where is `ArgumentParser` defined in `argparse.py`?",
    "Open `heapq.py` at line 30 and tell me what is there.",
])

SUITES = {s.name: s for s in (STANDARD, AGENT)}
TOOLS = STANDARD.tools
PROMPTS = STANDARD.prompts


class ToolCallCase(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prompt: str
    ok: bool  # request succeeded
    called: bool
    valid: bool  # every returned call: known tool, JSON arguments, schema-valid
    calls: list[dict]
    problems: list[str]


class ToolCallReport(BaseModel):
    model_config = ConfigDict(extra="forbid")

    suite: str
    prompts: int
    requests_failed: int
    trigger_rate: float  # prompts that produced at least one call
    schema_accuracy: float | None  # of prompts with calls, those whose calls are all schema-valid
    cases: list[ToolCallCase]


def validate_call(call: dict, tools: list[dict]) -> list[str]:
    """Problems with one OpenAI tool call against the declared tools (empty when valid)."""
    schemas = {t["function"]["name"]: t["function"].get("parameters") or {} for t in tools}
    fn = call.get("function") or {}
    name = fn.get("name")
    if name not in schemas:
        return [f"unknown tool {name!r} (declared: {', '.join(schemas)})"]
    try:
        args = json.loads(fn.get("arguments") or "")
    except json.JSONDecodeError as e:
        return [f"{name}: arguments are not JSON ({e.msg}): {fn.get('arguments')!r:.120}"]
    validator = jsonschema.Draft202012Validator(schemas[name])
    return [f"{name}: {err.message}" for err in validator.iter_errors(args)]


async def _case(client: ChatClient, suite: ToolCallSuite, prompt: str, max_tokens: int,
                extra: dict | None) -> ToolCallCase:
    res = await client.chat([{"role": "user", "content": prompt}], max_tokens=max_tokens, tools=suite.tools,
                            temperature=0.0, stream=False, extra=extra)
    if not res.ok:
        return ToolCallCase(prompt=prompt, ok=False, called=False, valid=False, calls=[], problems=[res.error])
    problems = [p for c in res.tool_calls for p in validate_call(c, suite.tools)]
    called = bool(res.tool_calls)
    return ToolCallCase(prompt=prompt, ok=True, called=called, valid=called and not problems,
                        calls=res.tool_calls, problems=problems)


async def run_tool_call_check(client: ChatClient, *, suite: str = "standard", max_tokens: int = 1024,
                              limit: int | None = None, extra: dict | None = None) -> ToolCallReport:
    chosen = SUITES[suite]
    prompts = chosen.prompts[:limit] if limit else chosen.prompts
    cases = [await _case(client, chosen, p, max_tokens, extra) for p in prompts]
    called = [c for c in cases if c.called]
    return ToolCallReport(
        suite=suite,
        prompts=len(cases),
        requests_failed=sum(not c.ok for c in cases),
        trigger_rate=len(called) / len(cases) if cases else 0.0,
        schema_accuracy=sum(c.valid for c in called) / len(called) if called else None,
        cases=cases,
    )

