"""generate_agent_sessions: real file contents, real grep and test output, deterministic for a seed."""

from __future__ import annotations

import json
import re

import pytest

from kimi_nvfp4.data.agent_sessions import TOOLS, generate_agent_sessions
from kimi_nvfp4.data.conversations import Role
from kimi_nvfp4.data.errors import DataError
from kimi_nvfp4.data.sandbox_checks import run_checks
from kimi_nvfp4.data.source_tree import SourceTree

# A tiny package tree with a doctest that passes, written per test; execute=True runs its doctests.
_MODULE = '''\
"""Small math helpers."""


def add(a, b):
    """Add two numbers.

    >>> add(2, 3)
    5
    """
    total = a + b
    return total


def scale(values, factor):
    result = [v * factor for v in values]
    return result


def shout(text):
    loud = text.upper()
    return loud + "!"
'''


@pytest.fixture
def tiny_tree(tmp_path):
    pkg = tmp_path / "repo" / "mathpkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "ops.py").write_text(_MODULE)
    (pkg / "use.py").write_text("from mathpkg.ops import add, scale\n\n\n"
                                "def double(x):\n    y = add(x, x)\n    return y\n")
    (tmp_path / "repo" / "README.md").write_text("Use `scale` to multiply lists.\n")
    return tmp_path / "repo"


def _tool_results(conv, *names):
    """(call, result) pairs of the named tools, in conversation order."""
    calls = {c.id: c for m in conv.messages for c in (m.tool_calls or ())}
    return [(calls[m.tool_call_id], m.content) for m in conv.messages
            if m.role is Role.TOOL and calls[m.tool_call_id].function.name in names]


def test_sessions_are_deterministic_for_a_seed(tiny_tree):
    a = generate_agent_sessions(tiny_tree, n=3, seed=7, max_turns=3)
    b = generate_agent_sessions(tiny_tree, n=3, seed=7, max_turns=3)
    c = generate_agent_sessions(tiny_tree, n=3, seed=8, max_turns=3)
    assert [x.to_json_line() for x in a] == [x.to_json_line() for x in b]
    assert [x.id for x in a] != [x.id for x in c]


def test_read_file_results_are_the_real_file_lines(tiny_tree):
    sessions = generate_agent_sessions(tiny_tree, n=4, seed=0, max_turns=3)
    seen = 0
    for conv in sessions:
        patched: set[str] = set()
        for call, content in _tool_results(conv, "read_file", "apply_patch"):
            args = json.loads(call.function.arguments)
            if call.function.name == "apply_patch":
                patched.add(re.search(r"\+\+\+ b/(\S+)", args["patch"]).group(1))
                continue
            if args["path"] in patched:
                continue  # reads after an edit show the working copy
            disk = (tiny_tree / args["path"]).read_text().splitlines()
            for line in content.splitlines()[1:]:
                number, text = line.split("\t", 1)
                assert disk[int(number) - 1] == text
                seen += 1
    assert seen > 10


def test_grep_results_are_real_matches(tiny_tree):
    for conv in generate_agent_sessions(tiny_tree, n=3, seed=1):
        for call, content in _tool_results(conv, "grep"):
            pattern = re.compile(json.loads(call.function.arguments)["pattern"])
            for line in content.splitlines():
                if line.startswith("[..."):
                    continue
                path, number, text = line.split(":", 2)
                assert pattern.search((tiny_tree / path).read_text().splitlines()[int(number) - 1])


def test_sessions_have_tools_calls_and_growing_context(tiny_tree):
    conv = generate_agent_sessions(tiny_tree, n=1, seed=3, max_turns=3, thinking_prob=1.0)[0]
    assert conv.tools == TOOLS
    assert conv.messages[0].role is Role.SYSTEM and conv.num_user_turns >= 2
    assert {c.function.name for m in conv.messages for c in (m.tool_calls or ())} >= {"grep", "read_file"}
    ids = [c.id for m in conv.messages for c in (m.tool_calls or ())]
    assert ids == [f"functions.{i.split('.')[1].split(':')[0]}:{n}" for n, i in enumerate(ids)]
    assert any(m.reasoning_content for m in conv.messages if m.role is Role.ASSISTANT)


def test_run_tests_output_is_real_and_executes_doctests(tiny_tree):
    sessions = generate_agent_sessions(tiny_tree, n=8, seed=0, execute=True)
    outputs = [content for conv in sessions for _, content in _tool_results(conv, "run_tests")]
    assert outputs, "some session must run the tests"
    for out in outputs:
        assert re.search(r"compile mathpkg/\w+\.py: ok", out)
        assert re.search(r"\[exit code \d+\]$", out)
    # a user tree is not importable by dotted name: compile only, unless importable
    assert not any("doctest" in o.splitlines()[1] for o in outputs)


def test_sandbox_runs_doctests_of_the_patched_copy(tiny_tree):
    tree = SourceTree.from_path(tiny_tree)
    tree.importable = True  # treat the repo root as an import root, like the stdlib
    ops = tree.get("mathpkg/ops.py")
    ok = run_checks(tree, ops, execute=True)
    assert ok.passed and "doctest mathpkg.ops (mathpkg/ops.py): 1 examples, 0 failures" in ok.output
    broken = run_checks(tree, ops, ops.text.replace("total = a + b", "total = a - b"), execute=True)
    assert not broken.passed and "1 failures" in broken.output and "Expected:" in broken.output
    assert str(tiny_tree) not in broken.output and "kimi_nvfp4_check_" not in broken.output
    # the original tree is untouched
    assert (tiny_tree / "mathpkg" / "ops.py").read_text() == _MODULE


def test_sandbox_reports_syntax_errors_from_compiling(tiny_tree):
    tree = SourceTree.from_path(tiny_tree)
    ops = tree.get("mathpkg/ops.py")
    out = run_checks(tree, ops, ops.text.replace("def add(a, b):", "def add(a, b)"), execute=False)
    assert not out.passed and "SyntaxError" in out.output


def test_default_tree_is_the_stdlib():
    conv = generate_agent_sessions(None, n=1, seed=0, max_turns=1)[0]
    assert "stdlib" in conv.messages[0].content
    for call, content in _tool_results(conv, "read_file"):
        path = json.loads(call.function.arguments)["path"]
        assert path.split("/")[0] in ("json", "email", "asyncio")


def test_tree_without_python_functions_is_a_data_error(tmp_path):
    (tmp_path / "notes.md").write_text("nothing to do\n")
    with pytest.raises(DataError, match="no Python file"):
        generate_agent_sessions(tmp_path, n=1)


def _apply_unified_diff(text: str, patch: str) -> str:
    """Apply a one-file unified diff, checking every context and removed line against `text`."""
    lines = text.splitlines()
    out, cursor = [], 0
    body = patch.splitlines()[2:]
    i = 0
    while i < len(body):
        start = int(re.match(r"@@ -(\d+)", body[i]).group(1)) - 1
        out.extend(lines[cursor:start])
        cursor = start
        i += 1
        while i < len(body) and not body[i].startswith("@@"):
            tag, line = body[i][:1], body[i][1:]
            if tag in (" ", "-"):
                assert lines[cursor] == line
                cursor += 1
            if tag in (" ", "+"):
                out.append(line)
            i += 1
    return "\n".join(out + lines[cursor:]) + "\n"


def test_patches_apply_to_the_file_and_compile(tiny_tree):
    applied = 0
    for conv in generate_agent_sessions(tiny_tree, n=6, seed=2):
        working: dict[str, str] = {}
        for call, content in _tool_results(conv, "apply_patch"):
            patch = json.loads(call.function.arguments)["patch"]
            path = re.search(r"\+\+\+ b/(\S+)", patch).group(1)
            before = working.get(path, (tiny_tree / path).read_text())
            working[path] = _apply_unified_diff(before, patch)
            compile(working[path], path, "exec")
            assert content.startswith(f"Applied patch to {path}: 1 hunk")
            applied += 1
    assert applied >= 2


@pytest.mark.parametrize("pattern", [r"\bjoin\b", "join", r"\bdef\b", r"jo.n", r"^\s+return", r"\bnot_a_word_anywhere\b"])
def test_tree_grep_equals_a_per_line_search(tiny_tree, pattern):
    """The word prefilter (files without the word are skipped) never changes what grep finds."""
    tree = SourceTree.from_path(tiny_tree)
    regex = re.compile(pattern)
    expected = [(f.rel, i, line) for f in tree.files for i, line in enumerate(f.lines, start=1) if regex.search(line)]
    assert tree.grep(pattern).matches == expected


def test_sessions_start_with_different_requests(tiny_tree):
    """No two sessions share their first request (while there are functions to go round)."""
    sessions = generate_agent_sessions(tiny_tree, n=4, seed=0, max_turns=2)
    firsts = [next(m.content for m in c.messages if m.role is Role.USER) for c in sessions]
    functions = [re.search(r"`(\w+)`", f).group(1) for f in firsts]
    assert len(set(functions)) == 4, firsts
    # the first request does not depend on how many sessions are made
    assert [c.messages[1].content for c in generate_agent_sessions(tiny_tree, n=2, seed=0, max_turns=2)] == firsts[:2]


def test_tool_results_come_with_and_without_a_name(tiny_tree):
    """Both forms agent clients send; a named result is named after the tool that was called."""
    sessions = generate_agent_sessions(tiny_tree, n=12, seed=0, max_turns=2)
    forms = set()
    for conv in sessions:
        calls = {c.id: c.function.name for m in conv.messages for c in (m.tool_calls or ())}
        results = [m for m in conv.messages if m.role is Role.TOOL]
        named = {m.name is not None for m in results}
        assert len(named) == 1  # one client, one habit
        forms |= named
        assert all(m.name in (None, calls[m.tool_call_id]) for m in results)
    assert forms == {True, False}
