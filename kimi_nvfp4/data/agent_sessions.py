"""Generate coding-agent sessions over a real source tree, deterministically for a seed.

Each session is what an agent harness sends a served model: a system prompt, declared tools
(read_file, grep, run_tests, apply_patch), user tasks about real functions in real files, and
assistant turns that call the tools with real arguments. Every tool result is real: grep output
from searching the tree, file contents read from disk, patches computed on the real source, and
test output from actually compiling/doctesting the patched copy in a sandboxed child process
(sandbox_checks). Context grows turn by turn, like Modal's workload (SPEC §5).

Session i starts with the i-th (file, function) of a seeded order (no two sessions share their
first request), and half the sessions' clients send tool results with the tool's `name` (both
forms real clients send; Kimi's template renders the name as the role).

What is synthetic: the wording of user requests, thinking text and final answers (templated
around the real facts). That is the part a quantizer's activations care least about; the long,
tool-heavy contexts are what calibration and validation need.
"""

from __future__ import annotations

import difflib
import json
import os
import random
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Callable

from tqdm import tqdm

from .conversations import Conversation
from .sandbox_checks import DEFAULT_TEST_TIMEOUT_S, CheckOutput, run_checks
from .source_tree import FunctionInfo, SourceFile, SourceTree

DEFAULT_SESSIONS = 32
DEFAULT_MAX_TURNS = 3
DEFAULT_THINKING_PROB = 0.5
DEFAULT_MAX_READ_LINES = 240
# Lines of context shown around a function when reading a window of a file.
READ_CONTEXT_LINES = 8
# Chance that a read covers the whole file (up to max_read_lines): long tool results.
WHOLE_FILE_READ_PROB = 0.3
# Chance that the agent reads a second file (a grep hit) in the same turn: parallel tool calls.
SECOND_READ_PROB = 0.35
# Chance that an explain task still runs the tests.
EXPLAIN_RUNS_TESTS_PROB = 0.5
# Concurrent sandbox checks (each one a short-lived child Python).
MAX_CHECK_WORKERS = 8
# Chance that a session's client sends tool results with a `name` (OpenAI allows it; Kimi's template
# then renders `<|im_system|>NAME<|im_middle|>` instead of `<|im_system|>tool<|im_middle|>`).
NAMED_TOOL_RESULT_PROB = 0.5
_RNG_NAMESPACE = "kimi-nvfp4-agent-sessions"

TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {
        "name": "read_file", "description": "Read a text file from the repository, with line numbers.",
        "parameters": {"type": "object", "properties": {
            "path": {"type": "string", "description": "Path relative to the repository root."},
            "start_line": {"type": "integer", "description": "First line to show (1-based)."},
            "end_line": {"type": "integer", "description": "Last line to show (inclusive)."}},
            "required": ["path"]}}},
    {"type": "function", "function": {
        "name": "grep", "description": "Search the repository for a regular expression; prints path:line:text.",
        "parameters": {"type": "object", "properties": {
            "pattern": {"type": "string", "description": "Python regular expression."},
            "path": {"type": "string", "description": "Folder to search, relative to the root."}},
            "required": ["pattern"]}}},
    {"type": "function", "function": {
        "name": "apply_patch", "description": "Apply a unified diff to the working tree.",
        "parameters": {"type": "object", "properties": {
            "patch": {"type": "string", "description": "Unified diff with a/ and b/ prefixes."}},
            "required": ["patch"]}}},
    {"type": "function", "function": {
        "name": "run_tests", "description": "Compile a file and run its module's doctests in a sandbox.",
        "parameters": {"type": "object", "properties": {
            "path": {"type": "string", "description": "File to test, relative to the root."}},
            "required": ["path"]}}},
]


class TaskKind(str, Enum):
    EXPLAIN = "explain"  # read and explain, no edit
    DOCUMENT = "document"  # add a docstring to an undocumented function
    GUARD = "guard"  # reject None for a parameter with a clear error


@dataclass
class _Session:
    """Mutable state while one session is built."""

    tree: SourceTree
    rng: random.Random
    thinking_prob: float
    max_read_lines: int
    execute: bool
    timeout_s: float
    messages: list[dict[str, Any]] = field(default_factory=list)
    named_results: bool = False  # this client sends `name` with tool results
    call_index: int = 0
    edited: dict[str, str] = field(default_factory=dict)  # rel -> patched text (the sandbox working copy)
    seen_files: list[str] = field(default_factory=list)
    used_functions: set[str] = field(default_factory=set)  # "rel::qualname" already asked about
    # (rel, text) -> pending output, shared by the sessions of one generate call: the same file content
    # gives the same real output, so it is run once. Checks run in a thread pool while sessions are
    # planned (no random choice depends on a check's result), and texts that quote a result are
    # filled in afterwards through `fixups`.
    pool: ThreadPoolExecutor | None = None
    check_cache: dict[tuple[str, str], Future[CheckOutput]] = field(default_factory=dict)
    fixups: list[tuple[dict[str, Any], Callable[[], str]]] = field(default_factory=list)

    def thinking(self, text: str) -> str | None:
        return text if self.rng.random() < self.thinking_prob else None

    def call(self, reasoning: str | None, content: str | None, calls: list[tuple[str, dict[str, Any]]]) -> list[str]:
        ids = []
        tool_calls = []
        for name, args in calls:
            call_id = f"functions.{name}:{self.call_index}"  # Kimi's tool-call id format (docs/formats.md §1)
            self.call_index += 1
            ids.append(call_id)
            tool_calls.append({"id": call_id, "type": "function",
                               "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}})
        message: dict[str, Any] = {"role": "assistant", "content": content, "tool_calls": tool_calls}
        if reasoning:
            message["reasoning_content"] = reasoning
        self.messages.append(message)
        return ids

    def result(self, call_id: str, content: str) -> dict[str, Any]:
        # Both forms clients send: {role: tool, tool_call_id, content} (OpenAI SDK agents), and the
        # same with the tool's `name`, which Kimi's templates render as `<|im_system|>NAME<|im_middle|>`.
        message = {"role": "tool", "tool_call_id": call_id, "content": content}
        if self.named_results:
            message["name"] = call_id.removeprefix("functions.").rsplit(":", 1)[0]
        self.messages.append(message)
        return message

    def later(self, message: dict[str, Any], content: Callable[[], str]) -> None:
        """Set message["content"] once the pending checks have finished."""
        self.fixups.append((message, content))

    def text_of(self, rel: str) -> str:
        return self.edited.get(rel, self.tree.get(rel).text)


def _is_dunder(func: FunctionInfo) -> bool:
    return func.name.startswith("__") and func.name.endswith("__")


def _task_functions(file: SourceFile, used: set[str]) -> list[FunctionInfo]:
    """Functions a new task can be about: not yet used in this session, named ones before dunders
    (grepping `__init__` matches half the tree)."""
    fresh = [f for f in file.functions if f"{file.rel}::{f.qualname}" not in used]
    named = [f for f in fresh if not _is_dunder(f)]
    return named or fresh


def _guardable(func: FunctionInfo) -> bool:
    return bool(func.params) and func.body_lineno > func.lineno


def _pick_task(file: SourceFile, rng: random.Random, used: set[str],
               func: FunctionInfo | None = None) -> tuple[FunctionInfo, TaskKind]:
    """A task about `func`, or about a function of `file` chosen here."""
    functions = [func] if func is not None else (_task_functions(file, used) or file.functions)
    undocumented = [f for f in functions if not f.has_docstring]
    guardable = [f for f in functions if _guardable(f)]
    choices = [TaskKind.EXPLAIN]
    if undocumented:
        choices.append(TaskKind.DOCUMENT)
    if guardable:
        choices.append(TaskKind.GUARD)
    kind = rng.choice(choices)
    pool = {TaskKind.EXPLAIN: functions, TaskKind.DOCUMENT: undocumented, TaskKind.GUARD: guardable}[kind]
    return rng.choice(pool), kind


def _user_request(kind: TaskKind, func: FunctionInfo, rel: str, rng: random.Random, first: bool) -> str:
    lead = "" if first else rng.choice(["Thanks. ", "OK, next: ", "Good. Now ", ""])
    if kind is TaskKind.EXPLAIN:
        ask = rng.choice([f"explain what `{func.qualname}` in {rel} does and who calls it.",
                          f"I don't understand `{func.qualname}` ({rel}). Walk me through it.",
                          f"where is `{func.name}` from {rel} used, and what does it return?"])
    elif kind is TaskKind.DOCUMENT:
        ask = rng.choice([f"`{func.qualname}` in {rel} has no docstring. Add one and make sure tests still pass.",
                          f"please document `{func.qualname}` in {rel}; keep the change minimal."])
    else:
        param = func.params[0]
        ask = rng.choice([f"make `{func.qualname}` in {rel} fail fast with a TypeError when `{param}` is None, "
                          "then run the tests.",
                          f"add a None check for the `{param}` argument of `{func.qualname}` ({rel})."])
    if not lead or lead.endswith(". "):
        ask = ask[0].upper() + ask[1:]
    return lead + ask


def _docstring_patch(text: str, func: FunctionInfo) -> str:
    lines = text.splitlines(keepends=True)
    indent = " " * func.body_indent
    args = ", ".join(f"`{p}`" for p in func.params) or "no arguments"
    doc = f'{indent}"""{func.name.strip("_").replace("_", " ").capitalize()} (takes {args})."""\n'
    lines.insert(func.body_lineno - 1, doc)
    return "".join(lines)


def _guard_patch(text: str, func: FunctionInfo) -> str:
    lines = text.splitlines(keepends=True)
    indent = " " * func.body_indent
    param = func.params[0]
    guard = [f"{indent}if {param} is None:\n",
             f"{indent}    raise TypeError(\"{func.name}() argument '{param}' must not be None\")\n"]
    insert_at = func.docstring_end_lineno if func.docstring_end_lineno else func.body_lineno - 1
    lines[insert_at:insert_at] = guard
    return "".join(lines)


def _unified_diff(rel: str, before: str, after: str) -> str:
    return "".join(difflib.unified_diff(before.splitlines(keepends=True), after.splitlines(keepends=True),
                                        fromfile=f"a/{rel}", tofile=f"b/{rel}", n=3))


def _read_range(func: FunctionInfo, file_lines: int, s: _Session) -> tuple[int, int]:
    if s.rng.random() < WHOLE_FILE_READ_PROB:
        return 1, min(file_lines, s.max_read_lines)
    start = max(1, func.lineno - READ_CONTEXT_LINES)
    end = min(file_lines, func.end_lineno + READ_CONTEXT_LINES, start + s.max_read_lines - 1)
    return start, end


def _read_tool_result(s: _Session, rel: str, start: int, end: int) -> str:
    lines = s.text_of(rel).splitlines()
    end = min(end, len(lines))
    body = "\n".join(f"{n:6}\t{lines[n - 1]}" for n in range(start, end + 1))
    return f"{rel} (lines {start}-{end} of {len(lines)})\n{body}"


def _run_tests(s: _Session, rel: str) -> Future[CheckOutput]:
    key = (rel, s.text_of(rel))
    if key not in s.check_cache:
        assert s.pool is not None
        s.check_cache[key] = s.pool.submit(run_checks, s.tree, s.tree.get(rel), s.edited.get(rel),
                                           execute=s.execute, timeout_s=s.timeout_s)
    return s.check_cache[key]


def _test_fact(check: CheckOutput) -> str:
    last = check.output.strip().splitlines()[-1] if check.output.strip() else ""
    return ("Tests pass" if check.passed else "Tests FAIL") + (f" ({last})" if last else "") + "."


def _turn(s: _Session, file: SourceFile, first: bool, qualname: str | None = None) -> None:
    """One user request and the agent's tool loop answering it (about `qualname` when given)."""
    rel = file.rel
    # Line numbers must match the working copy, so pick functions from the (maybe patched) text.
    current = SourceFile(rel, s.text_of(rel))
    chosen = next((f for f in current.functions if f.qualname == qualname), None) if qualname else None
    func, kind = _pick_task(current, s.rng, s.used_functions, chosen)
    s.used_functions.add(f"{rel}::{func.qualname}")
    s.messages.append({"role": "user", "content": _user_request(kind, func, rel, s.rng, first)})

    # 1. find the definition and its uses
    pattern = rf"\b{func.name}\b"
    grep = s.tree.grep(pattern)
    (grep_id,) = s.call(s.thinking(f"I should locate `{func.name}` first and see how it is used."),
                        None if s.rng.random() < 0.5 else f"Let me search for `{func.name}`.",
                        [("grep", {"pattern": pattern, "path": "."})])
    s.result(grep_id, grep.render())

    # 2. read the definition (and sometimes a caller's file, in parallel)
    start, end = _read_range(func, len(current.lines), s)
    reads = [(rel, start, end)]
    others = [f for f in grep.files if f != rel and f.endswith(".py")]
    if others and s.rng.random() < SECOND_READ_PROB:
        other = s.rng.choice(others)
        hit = next(n for r, n, _ in grep.matches if r == other)
        reads.append((other, max(1, hit - READ_CONTEXT_LINES), hit + 2 * READ_CONTEXT_LINES))
    n_files = len(grep.files)
    ids = s.call(s.thinking(f"grep found {len(grep.matches)} matches in {n_files} file(s); the definition is at "
                            f"{rel}:{func.lineno}. Reading it."),
                 None, [("read_file", {"path": r, "start_line": a, "end_line": b}) for r, a, b in reads])
    for call_id, (r, a, b) in zip(ids, reads):
        s.result(call_id, _read_tool_result(s, r, a, b))
        if r not in s.seen_files:
            s.seen_files.append(r)

    # 3. edit, then test
    check: Future[CheckOutput] | None = None
    if kind is not TaskKind.EXPLAIN:
        before = current.text
        after = _docstring_patch(before, func) if kind is TaskKind.DOCUMENT else _guard_patch(before, func)
        diff = _unified_diff(rel, before, after)
        added = sum(1 for ln in diff.splitlines() if ln.startswith("+") and not ln.startswith("+++"))
        (patch_id,) = s.call(s.thinking(f"The body of `{func.name}` starts at line {func.body_lineno}; "
                                        f"I'll insert {added} line(s) there."), None,
                             [("apply_patch", {"patch": diff})])
        s.edited[rel] = after
        s.result(patch_id, f"Applied patch to {rel}: 1 hunk, +{added} -0 lines.")
    if kind is not TaskKind.EXPLAIN or s.rng.random() < EXPLAIN_RUNS_TESTS_PROB:
        pending = check = _run_tests(s, rel)
        (test_id,) = s.call(None, "Running the tests." if s.rng.random() < 0.5 else None,
                            [("run_tests", {"path": rel})])
        s.later(s.result(test_id, ""), lambda: pending.result().render())

    # 4. answer, grounded in what the tools returned
    callers = sorted({r for r, n, _ in grep.matches} - {rel})
    facts = [f"`{func.qualname}` is defined at {rel}:{func.lineno}-{func.end_lineno} as `{func.signature}`.",
             f"It is referenced {len(grep.matches)} time(s) in {n_files} file(s)"
             + (f", including {', '.join(callers[:3])}." if callers else ", all in this file.")]
    if kind is TaskKind.DOCUMENT:
        facts.append("I added a one-line docstring at the top of its body.")
    elif kind is TaskKind.GUARD:
        facts.append(f"It now raises TypeError when `{func.params[0]}` is None.")
    reasoning = s.thinking("Summarise: location, signature, references" + (", test result." if check else "."))
    final: dict[str, Any] = {"role": "assistant", "content": " ".join(facts)}
    if reasoning:
        final["reasoning_content"] = reasoning
    s.messages.append(final)
    if check is not None:
        checked = check
        s.later(final, lambda: " ".join([*facts, _test_fact(checked.result())]))


def _session_starts(start_files: list[SourceFile], seed: int) -> list[tuple[SourceFile, str]]:
    """Every (file, function) a session can start with, in a seeded order that does not depend on n.

    Session i starts with entry i (modulo the count): no two sessions of a generate call share
    their first request unless there are more sessions than functions. Sessions that began alike
    would share a long prefix, and their windows could turn up on both sides of the held-out split.
    """
    starts = [(f, fn.qualname) for f in start_files for fn in (_task_functions(f, set()) or f.functions)]
    random.Random(f"{_RNG_NAMESPACE}:{seed}:starts").shuffle(starts)
    return starts


def _system_prompt(tree: SourceTree) -> str:
    return (f"You are a coding agent working in the repository `{tree.name}`. Use the tools to search, read "
            "files, apply patches and run tests. Ground every answer in tool output and keep it short.")


def generate_agent_sessions(source_tree: str | Path | SourceTree | None = None, n: int = DEFAULT_SESSIONS,
                            seed: int = 0, max_turns: int = DEFAULT_MAX_TURNS, *,
                            thinking_prob: float = DEFAULT_THINKING_PROB,
                            max_read_lines: int = DEFAULT_MAX_READ_LINES, execute: bool | None = None,
                            test_timeout_s: float = DEFAULT_TEST_TIMEOUT_S, workers: int | None = None,
                            progress: bool = False) -> list[Conversation]:
    """`n` agent sessions over `source_tree` (default: stdlib json/email/asyncio), same output for a seed.

    `execute` runs doctests of the patched module in a sandbox child process; default True for
    the stdlib and False for a user's tree (then `run_tests` only compiles, running no tree code).
    `workers` child processes run the checks concurrently (default: CPU count, at most 8); the
    output does not depend on it.
    """
    if n < 1 or max_turns < 1:
        raise ValueError(f"n and max_turns must be >= 1, got n={n}, max_turns={max_turns}")
    if isinstance(source_tree, SourceTree):
        tree = source_tree
    else:
        tree = SourceTree.stdlib() if source_tree is None else SourceTree.from_path(source_tree)
    execute = tree.importable if execute is None else execute
    workers = workers or min(MAX_CHECK_WORKERS, os.cpu_count() or 1)
    check_cache: dict[tuple[str, str], Future[CheckOutput]] = {}
    start_files = [f for f in tree.task_files if any(not _is_dunder(fn) for fn in f.functions)] or tree.task_files
    starts = _session_starts(start_files, seed)
    planned: list[_Session] = []
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="session-checks") as pool:
        for index in range(n):
            rng = random.Random(f"{_RNG_NAMESPACE}:{seed}:{index}")
            s = _Session(tree, rng, thinking_prob, max_read_lines, execute, test_timeout_s, pool=pool,
                         check_cache=check_cache)
            # its own stream, so the choice does not move any other
            s.named_results = random.Random(f"{_RNG_NAMESPACE}:{seed}:{index}:names").random() < NAMED_TOOL_RESULT_PROB
            s.messages.append({"role": "system", "content": _system_prompt(tree)})
            file, first_function = starts[index % len(starts)]
            turns = rng.randint(min(2, max_turns), max_turns)
            for turn in range(turns):
                _turn(s, file, first=turn == 0, qualname=first_function if turn == 0 else None)
                # follow-up: stay in the file while it has fresh functions, or move to a file already read
                candidates = [r for r in s.seen_files if _task_functions(tree.get(r), s.used_functions)]
                stay = file.rel in candidates and rng.random() < 0.5
                if not stay and candidates:
                    file = tree.get(rng.choice(candidates))
                elif not stay:
                    file = rng.choice(start_files)
            planned.append(s)
        sessions = []
        for s in tqdm(planned, desc="agent sessions", unit="session", disable=not progress):
            for message, content in s.fixups:
                message["content"] = content()
            sessions.append(Conversation.model_validate({"messages": s.messages, "tools": TOOLS}))
    return sessions
