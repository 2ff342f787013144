"""A read-only index of a local source tree: the files an agent session reads and greps.

Bounded: at most MAX_FILES text files of at most MAX_FILE_BYTES each, MAX_TREE_BYTES in all,
walked in sorted order so the same tree always gives the same index. Python files are parsed
with `ast` (parsed, never executed) to find the functions a task can be about.
"""

from __future__ import annotations

import ast
import os
import re
import sys
import sysconfig
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from .errors import DataError

# Default tree: pure-Python stdlib packages with doctests and cross-module references.
DEFAULT_STDLIB_PACKAGES = ("json", "email", "asyncio")
TEXT_SUFFIXES = frozenset({".py", ".pyi", ".md", ".rst", ".txt", ".toml", ".cfg", ".ini", ".yaml", ".yml",
                           ".json", ".sh", ".c", ".h", ".cc", ".cpp", ".rs", ".go", ".js", ".ts"})
SKIP_DIRS = frozenset({".git", ".hg", "__pycache__", "node_modules", ".venv", "venv", "build", "dist", ".tox",
                       ".mypy_cache", ".pytest_cache", ".ruff_cache", "site-packages", ".eggs"})
MAX_FILES = 4000
MAX_FILE_BYTES = 256 * 1024
MAX_TREE_BYTES = 64 * 1024 * 1024
# Grep output is cut after this many matching lines (the total is still reported).
MAX_GREP_RESULTS = 20
MAX_GREP_LINE_CHARS = 160
# Functions shorter than this are too trivial to build a task around.
MIN_FUNCTION_LINES = 3


@dataclass(frozen=True)
class FunctionInfo:
    """A function or method found by `ast` in a Python file."""

    qualname: str  # Class.method or function
    name: str
    lineno: int  # 1-based, the `def` line (decorators excluded)
    end_lineno: int
    body_lineno: int  # first statement of the body
    body_indent: int  # column of the first body statement
    docstring_end_lineno: int | None  # last line of the docstring, None when it has none
    params: tuple[str, ...]  # positional/keyword parameters except self/cls
    signature: str  # `name(a, b=1)`

    @property
    def has_docstring(self) -> bool:
        return self.docstring_end_lineno is not None


# `\bname\b`, `name`: patterns whose every match contains the word itself (see `SourceTree.grep`).
_WORD_PATTERN = re.compile(r"(?:\\b)?(?P<word>\w+)(?:\\b)?")


@dataclass(frozen=True)
class SourceFile:
    rel: str  # posix path relative to the tree root
    text: str

    @cached_property
    def lines(self) -> list[str]:
        return self.text.splitlines()

    @property
    def is_python(self) -> bool:
        return self.rel.endswith(".py")

    @cached_property
    def module(self) -> str:
        """Dotted module name when the tree root is an import root (stdlib), e.g. `json.decoder`."""
        parts = self.rel[: -len(".py")].split("/")
        if parts[-1] == "__init__":
            parts = parts[:-1]
        return ".".join(parts)

    @cached_property
    def functions(self) -> list[FunctionInfo]:
        if not self.is_python:
            return []
        try:
            tree = ast.parse(self.text)
        except (SyntaxError, ValueError):
            return []
        found: list[FunctionInfo] = []
        _collect_functions(tree, "", found)
        return [f for f in found if f.end_lineno - f.lineno + 1 >= MIN_FUNCTION_LINES]


def _collect_functions(node: ast.AST, prefix: str, out: list[FunctionInfo]) -> None:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.ClassDef):
            _collect_functions(child, f"{prefix}{child.name}.", out)
        elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
            first = child.body[0]
            doc_end = None
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                doc_end = first.end_lineno
            args = child.args
            params = tuple(a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)
                           if a.arg not in ("self", "cls"))
            out.append(FunctionInfo(
                qualname=f"{prefix}{child.name}", name=child.name, lineno=child.lineno,
                end_lineno=child.end_lineno or child.lineno, body_lineno=first.lineno,
                body_indent=first.col_offset, docstring_end_lineno=doc_end, params=params,
                signature=f"{child.name}({ast.unparse(args)})",
            ))


@dataclass
class GrepResult:
    pattern: str
    matches: list[tuple[str, int, str]]  # (rel, line number, line text), all of them
    files: list[str] = field(default_factory=list)

    def render(self, max_results: int = MAX_GREP_RESULTS) -> str:
        """`path:line:text` lines like `grep -rn`, cut after max_results."""
        if not self.matches:
            return f"no matches for /{self.pattern}/"
        shown = [f"{rel}:{n}:{text.rstrip()[:MAX_GREP_LINE_CHARS]}" for rel, n, text in self.matches[:max_results]]
        hidden = len(self.matches) - len(shown)
        if hidden > 0:
            shown.append(f"[... {hidden} more matches in {len(self.files)} files]")
        return "\n".join(shown)


class SourceTree:
    """Text files of one folder (or several stdlib packages), loaded once, read-only."""

    def __init__(self, root: Path, files: list[SourceFile], name: str, importable: bool):
        self.root = root
        self.files = files
        self.name = name
        # True when `root` is on sys.path by nature (stdlib): modules can be imported by dotted name.
        self.importable = importable
        self._by_rel = {f.rel: f for f in files}

    @classmethod
    def from_path(cls, path: str | Path) -> SourceTree:
        root = Path(path).resolve()
        if not root.is_dir():
            raise DataError(f"tree {path}: not a folder (expected a source tree, e.g. a git checkout)")
        files = _load_files(root, [root])
        return cls._checked(root, files, root.name, importable=False)

    @classmethod
    def stdlib(cls, packages: tuple[str, ...] = DEFAULT_STDLIB_PACKAGES) -> SourceTree:
        root = Path(sysconfig.get_paths()["stdlib"])
        dirs = [root / p for p in packages]
        missing = [str(d) for d in dirs if not d.is_dir()]
        if missing:
            raise DataError(f"stdlib packages not found: {missing}")
        name = f"python{sys.version_info.major}.{sys.version_info.minor}-stdlib ({', '.join(packages)})"
        return cls._checked(root, _load_files(root, dirs), name, importable=True)

    @classmethod
    def _checked(cls, root: Path, files: list[SourceFile], name: str, importable: bool) -> SourceTree:
        tree = cls(root, files, name, importable)
        if not tree.task_files:
            raise DataError(f"tree {root}: no Python file with a function of >= {MIN_FUNCTION_LINES} lines "
                            f"among {len(files)} text files")
        return tree

    @cached_property
    def task_files(self) -> list[SourceFile]:
        """Python files with at least one function to build a task around."""
        return [f for f in self.files if f.functions]

    def get(self, rel: str) -> SourceFile:
        return self._by_rel[rel]

    def grep(self, pattern: str) -> GrepResult:
        regex = re.compile(pattern)
        # A word pattern (what the session generator searches for: `\bname\b`) can only match a line of a
        # file whose text contains the word: a substring test skips most files before the per-line regex.
        word = _WORD_PATTERN.fullmatch(pattern)
        matches = []
        files = []
        for f in self.files:
            if word is not None and word.group("word") not in f.text:
                continue
            hits = [(f.rel, i, line) for i, line in enumerate(f.lines, start=1) if regex.search(line)]
            if hits:
                files.append(f.rel)
                matches.extend(hits)
        return GrepResult(pattern, matches, files)

    def read(self, rel: str, start: int, end: int) -> str:
        """Lines start..end (1-based, inclusive) numbered like `cat -n`."""
        lines = self.get(rel).lines
        start, end = max(1, start), min(len(lines), end)
        return "\n".join(f"{n:6}\t{lines[n - 1]}" for n in range(start, end + 1))


def _load_files(root: Path, dirs: list[Path]) -> list[SourceFile]:
    files: list[SourceFile] = []
    total = 0
    for top in dirs:
        for dirpath, dirnames, filenames in os.walk(top):
            dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.startswith("."))
            for name in sorted(filenames):
                path = Path(dirpath) / name
                if path.suffix not in TEXT_SUFFIXES or path.is_symlink():
                    continue
                size = path.stat().st_size
                if size > MAX_FILE_BYTES or total + size > MAX_TREE_BYTES:
                    continue
                try:
                    text = path.read_text(encoding="utf-8")
                except (UnicodeDecodeError, OSError):
                    continue
                total += size
                files.append(SourceFile(path.relative_to(root).as_posix(), text))
                if len(files) >= MAX_FILES:
                    return files
    return files
