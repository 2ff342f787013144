"""The registered scale methods as a markdown table, for docs/numerics.md (the docs list the registry's entries,
never a hand-kept copy; tests/numerics/test_registry.py checks the page against this rendering).

    python -m kimi_nvfp4.numerics.methods.docs docs/numerics.md    # rewrite the generated block in place
"""

from __future__ import annotations

import sys
from pathlib import Path

from .registry import METHODS, ExecutionPath

BEGIN = "<!-- scale methods: generated from the registry (python -m kimi_nvfp4.numerics.methods.docs docs/numerics.md) -->"
END = "<!-- end of scale methods -->"


def _options(spec) -> str:
    fields = spec.options_model.model_fields
    if not fields:
        return "none"
    return "<br>".join(f"`{name}={field.default}`: {field.description}" for name, field in fields.items())


def _paths(spec) -> str:
    paths = ", ".join(p.value for p in spec.paths)
    return paths if ExecutionPath.TRITON in spec.paths else f"{paths} (no Triton: {spec.no_triton})"


def methods_table() -> str:
    """One row per registered method: name, what it needs from calibration, execution paths, options, description."""
    rows = ["| method | statistics | execution paths | options (`--method-option KEY=VALUE`) | description |",
            "|---|---|---|---|---|"]
    for spec in METHODS.entries():
        cells = [f"`{spec.name}`", spec.statistics.value, _paths(spec), _options(spec), spec.description]
        rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(rows)


def generated_block() -> str:
    return f"{BEGIN}\n{methods_table()}\n{END}"


def rewrite(page: Path) -> bool:
    """Replace the generated block of `page`; True if it changed."""
    text = page.read_text()
    start, stop = text.index(BEGIN), text.index(END) + len(END)
    new = text[:start] + generated_block() + text[stop:]
    if new != text:
        page.write_text(new)
    return new != text


if __name__ == "__main__":
    print("rewritten" if rewrite(Path(sys.argv[1])) else "up to date")
