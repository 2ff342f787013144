"""Writing human- and machine-readable report files atomically (shared by calibrate and validate)."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any, Sequence

from pydantic import BaseModel

from ..checkpoint.writer import write_bytes_atomic


def save_model_json(path: Path, model: BaseModel) -> Path:
    write_bytes_atomic(path, (model.model_dump_json(indent=2) + "\n").encode())
    return path


def save_text(path: Path, text: str) -> Path:
    write_bytes_atomic(path, text.encode())
    return path


def save_figure(path: Path, fig: Any) -> Path:
    """Render a matplotlib figure to PNG in memory, then write it atomically and close it."""
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    write_bytes_atomic(path, buf.getvalue())
    return path


def new_figure(width: float = 8.0, height: float = 4.0) -> tuple[Any, Any]:
    """A figure on the non-interactive Agg backend (no display needed, CI-safe)."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=(width, height))


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    def cell(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.4g}"
        return str(v).replace("|", "\\|")

    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)
