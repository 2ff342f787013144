"""Render docs/benchmarks.md's measured tables from the JSON result files in bench/results/.

Each generated table sits between two markers in the document:

    <!-- generated: NAME (from bench/results/A.json[, bench/results/B.json ...]; command: CMD) -->
    ...rendered markdown...
    <!-- /generated -->

NAME picks a renderer in `bench/renderers` (one function per table); the files are loaded in the order
given and handed to it; CMD is how the files were made (shown for files that do not record their own
`command`). Text outside the markers is hand-written and left as it is.

    python bench/render_benchmarks.py           # rewrite the generated blocks in place
    python bench/render_benchmarks.py --check   # exit 1 and print the diff if the document is stale
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run as `python bench/render_benchmarks.py`: make `bench` importable
    sys.path.insert(0, str(REPO_ROOT))

from bench.renderers import REGISTRY, BenchmarkRenderError, BlockContext, ResultFile  # noqa: E402

DOC_PATH = Path("docs/benchmarks.md")
RESULTS_DIR = Path("bench/results")
CLOSE_MARKER = "<!-- /generated -->"
OPEN_MARKER = re.compile(
    r"^<!-- generated: (?P<name>[A-Za-z0-9_-]+) \(from (?P<files>[^;]+); command: (?P<command>.+)\) -->$"
)
# Lines that look like a marker but do not parse are refused, so a typo cannot leave a stale table behind.
MARKER_PREFIX = "<!-- generated"
EXIT_STALE = 1
EXIT_ERROR = 2

__all__ = [
    "BenchmarkRenderError",
    "Block",
    "check_document",
    "find_blocks",
    "load_result",
    "main",
    "render_block",
    "render_document",
]


@dataclass(frozen=True)
class Block:
    """One generated block: its marker's fields and the line span of its body (between the markers)."""

    name: str
    files: tuple[str, ...]
    command: str
    open_line: int  # index of the opening marker's line
    close_line: int  # index of the closing marker's line

    @property
    def marker(self) -> str:
        return f"<!-- generated: {self.name} (from {', '.join(self.files)}; command: {self.command}) -->"


def find_blocks(text: str, doc_name: str = str(DOC_PATH)) -> list[Block]:
    """The generated blocks of a document, in order; malformed, nested or unclosed markers are errors."""
    blocks: list[Block] = []
    lines = text.split("\n")
    open_block: tuple[int, re.Match] | None = None
    for i, line in enumerate(lines):
        # Markers start a line; an indented one (a code example in the page's own how-to) is text.
        stripped = line.rstrip()
        if stripped == CLOSE_MARKER:
            if open_block is None:
                raise BenchmarkRenderError(f"{doc_name}:{i + 1}: {CLOSE_MARKER} without an opening marker")
            start, match = open_block
            files = tuple(f.strip() for f in match["files"].split(",") if f.strip())
            if not files:
                raise BenchmarkRenderError(f"{doc_name}:{start + 1}: block {match['name']!r} names no result file")
            blocks.append(Block(match["name"], files, match["command"].strip(), start, i))
            open_block = None
        elif stripped.startswith(MARKER_PREFIX):
            match = OPEN_MARKER.match(stripped)
            if match is None:
                raise BenchmarkRenderError(
                    f"{doc_name}:{i + 1}: malformed marker {stripped!r}; expected "
                    "'<!-- generated: NAME (from bench/results/FILE.json; command: CMD) -->'"
                )
            if open_block is not None:
                raise BenchmarkRenderError(
                    f"{doc_name}:{i + 1}: block {match['name']!r} opens inside block {open_block[1]['name']!r}"
                )
            open_block = (i, match)
    if open_block is not None:
        raise BenchmarkRenderError(
            f"{doc_name}:{open_block[0] + 1}: block {open_block[1]['name']!r} has no closing {CLOSE_MARKER}"
        )
    return blocks


def load_result(root: Path, rel_path: str, block: str) -> ResultFile:
    """Load one result file named by a block; a missing or unreadable file is an error naming it."""
    path = root / rel_path
    if not path.is_file():
        raise BenchmarkRenderError(f"{rel_path}: result file not found (named by generated block {block!r})")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BenchmarkRenderError(f"{rel_path}: not readable JSON ({exc}; named by block {block!r})") from exc
    return ResultFile(rel_path, data)


def render_block(block: Block, root: Path) -> str:
    """The markdown between a block's markers (without them), from its result files."""
    fn = REGISTRY.get(block.name)
    if fn is None:
        known = ", ".join(sorted(REGISTRY))
        raise BenchmarkRenderError(f"block {block.name!r}: no renderer of that name in bench/renderers (known: {known})")
    results = tuple(load_result(root, f, block.name) for f in block.files)
    try:
        body = fn(BlockContext(block.name, results, block.command))
    except (KeyError, TypeError, ZeroDivisionError) as exc:
        # A result file of another shape than the renderer reads: say which block and files, not a traceback.
        raise BenchmarkRenderError(
            f"block {block.name!r}: cannot render from {', '.join(block.files)} ({type(exc).__name__}: {exc})"
        ) from exc
    return body.strip("\n")


def render_document(text: str, root: Path = REPO_ROOT, doc_name: str = str(DOC_PATH)) -> str:
    """The document with every generated block re-rendered; everything outside the markers unchanged."""
    lines = text.split("\n")
    out: list[str] = []
    cursor = 0
    for block in find_blocks(text, doc_name):
        out += lines[cursor : block.open_line]
        # Blank lines around the body: a table must not run into the closing comment in a markdown renderer.
        out += [block.marker, "", render_block(block, root), "", CLOSE_MARKER]
        cursor = block.close_line + 1
    out += lines[cursor:]
    return "\n".join(out)


def check_document(doc: Path, root: Path = REPO_ROOT) -> str:
    """A unified diff from the document to what its result files render ('' when it is up to date)."""
    current = doc.read_text()
    rendered = render_document(current, root, _display(doc, root))
    if rendered == current:
        return ""
    name = _display(doc, root)
    return "".join(difflib.unified_diff(
        current.splitlines(keepends=True), rendered.splitlines(keepends=True),
        fromfile=f"{name} (as committed)", tofile=f"{name} (rendered from {RESULTS_DIR})",
    ))


def write_document(doc: Path, root: Path = REPO_ROOT) -> bool:
    """Re-render the document in place (a temporary file renamed over it); True if it changed."""
    current = doc.read_text()
    rendered = render_document(current, root, _display(doc, root))
    if rendered == current:
        return False
    fd, tmp = tempfile.mkstemp(dir=doc.parent, prefix=f".{doc.name}.", suffix=".partial")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(rendered)
        os.replace(tmp, doc)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return True


def _display(path: Path, root: Path) -> str:
    try:
        return str(path.resolve().relative_to(root.resolve()))
    except ValueError:
        return str(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help=f"do not write; exit {EXIT_STALE} and print the diff if the document is stale")
    parser.add_argument("--doc", type=Path, default=None, help=f"document to render (default: {DOC_PATH})")
    parser.add_argument("--root", type=Path, default=REPO_ROOT,
                        help="repository root the markers' result paths are relative to")
    args = parser.parse_args(argv)
    doc = args.doc or args.root / DOC_PATH
    try:
        if args.check:
            diff = check_document(doc, args.root)
            if diff:
                sys.stdout.write(diff)
                print(f"{_display(doc, args.root)} is not what {RESULTS_DIR}/ renders; "
                      "run: python bench/render_benchmarks.py", file=sys.stderr)
                return EXIT_STALE
            return 0
        changed = write_document(doc, args.root)
        print(f"{_display(doc, args.root)}: {'updated' if changed else 'up to date'}")
        return 0
    except (BenchmarkRenderError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":
    raise SystemExit(main())
