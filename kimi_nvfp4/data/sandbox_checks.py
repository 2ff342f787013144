"""Run a session's `run_tests` tool for real: compile and doctest a (patched) copy in a temp dir.

The check runs in a child Python with a timeout, a minimal environment, a fixed hash seed and
its own temporary working directory; the original tree is never written. Only the code of the
tree being studied runs, and only when `execute=True` (the stdlib by default; a user's tree is
only compiled unless they ask for doctests). Output is real, with the temp dir's path replaced
by the tree-relative path so a seed always gives the same text.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .source_tree import SKIP_DIRS, SourceFile, SourceTree

DEFAULT_TEST_TIMEOUT_S = 20.0
# Tool output longer than this is cut (agent harnesses truncate tool results too).
MAX_TEST_OUTPUT_LINES = 60
# A package bigger than this is not copied; only the file under test is.
MAX_PACKAGE_COPY_BYTES = 8 * 1024 * 1024

# The child's program: compile the file (never writes .pyc), then import the module from the temp
# copy and run its doctests. Our own code, passed with -c; nothing from the tree is read as a script.
_CHECK_PROGRAM = """\
import doctest, importlib, os, sys
module_name, rel = sys.argv[1], sys.argv[2]
with open(rel, encoding="utf-8") as f:
    compile(f.read(), rel, "exec")
print(f"compile {rel}: ok")
if module_name:
    sys.path.insert(0, os.getcwd())
    module = importlib.import_module(module_name)
    where = os.path.relpath(module.__file__, os.getcwd())
    if where.startswith(".."):
        sys.exit(f"refusing to test {module_name}: imported from outside the sandbox")
    public = [n for n in dir(module) if not n.startswith("_")]
    print(f"import {module_name}: ok ({len(public)} public names)")
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    print(f"doctest {module_name} ({where}): {result.attempted} examples, {result.failed} failures")
    sys.exit(1 if result.failed else 0)
"""


@dataclass(frozen=True)
class CheckOutput:
    description: str  # what ran, e.g. "compile + doctest json.decoder"
    output: str
    returncode: int  # child exit status; -1 when it timed out

    @property
    def passed(self) -> bool:
        return self.returncode == 0

    def render(self) -> str:
        status = "timed out" if self.returncode < 0 else f"exit code {self.returncode}"
        return f"$ {self.description}\n{self.output.rstrip()}\n[{status}]"


def _package_dir(tree: SourceTree, file: SourceFile) -> str | None:
    top = file.rel.split("/")[0]
    if top == file.rel:  # a top-level module, no package to copy
        return None
    size = sum(f.stat().st_size for f in (tree.root / top).rglob("*.py") if f.is_file())
    return top if size <= MAX_PACKAGE_COPY_BYTES else None


def _child_env() -> dict[str, str]:
    # Fixed hash seed: doctest output that prints sets/dicts must not vary between runs.
    return {"PATH": os.defpath, "PYTHONHASHSEED": "0", "PYTHONDONTWRITEBYTECODE": "1", "PYTHONNOUSERSITE": "1",
            "PYTHONIOENCODING": "utf-8", "LC_ALL": "C.UTF-8", "HOME": tempfile.gettempdir()}


def _truncate(text: str) -> str:
    lines = text.splitlines()
    if len(lines) <= MAX_TEST_OUTPUT_LINES:
        return text
    kept = lines[:MAX_TEST_OUTPUT_LINES]
    return "\n".join([*kept, f"[... {len(lines) - len(kept)} more lines]"])


def run_checks(tree: SourceTree, file: SourceFile, text: str | None = None, *, execute: bool,
               timeout_s: float = DEFAULT_TEST_TIMEOUT_S) -> CheckOutput:
    """Compile `file` (with `text` replacing its contents when given) and, if `execute` and the
    tree is importable, run its module's doctests against the copy."""
    text = file.text if text is None else text
    run_doctests = execute and tree.importable
    with tempfile.TemporaryDirectory(prefix="kimi_nvfp4_check_") as tmp:
        sandbox = Path(tmp)
        package = _package_dir(tree, file) if run_doctests else None
        if package is not None:
            shutil.copytree(tree.root / package, sandbox / package,
                            ignore=shutil.ignore_patterns(*SKIP_DIRS, "*.pyc"))
        target = sandbox / file.rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text, encoding="utf-8")
        module = file.module if (run_doctests and (package is not None or "/" not in file.rel)) else ""
        description = f"python -c <compile{' + doctest ' + module if module else ''}> {file.rel}"
        try:
            proc = subprocess.run(
                [sys.executable, "-s", "-B", "-c", _CHECK_PROGRAM, module, file.rel],
                cwd=sandbox, env=_child_env(), stdin=subprocess.DEVNULL, capture_output=True,
                text=True, encoding="utf-8", errors="replace", timeout=timeout_s,
            )
            output, code = proc.stdout + proc.stderr, proc.returncode
        except subprocess.TimeoutExpired as e:
            partial = (e.stdout or "") if isinstance(e.stdout, str) else ""
            output, code = partial + f"\ntimed out after {timeout_s:g}s", -1
        output = output.replace(str(sandbox) + os.sep, "").replace(str(sandbox), ".")
        return CheckOutput(description, _truncate(output), code)
