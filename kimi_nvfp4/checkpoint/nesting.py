"""Refuse an output folder inside its source, a source inside its output, or the two being one folder.

Checked (with symlinks resolved) before anything is written or deleted: an output inside the source feeds on
itself (a resume copies the source's files, now including the half-finished output), and a source inside the
output is deleted by `convert --overwrite`, which empties the output folder.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import OutputError


def refuse_nested(source: str | Path, output: str | Path) -> None:
    """Raise OutputError when `source` and `output` are the same folder or one lies inside the other."""
    src, out = Path(os.path.realpath(source)), Path(os.path.realpath(output))
    where = f"(resolved: source {src}, output {out})"
    if out == src:
        raise OutputError(f"file {output}: the output folder is the source folder {where}; choose another folder")
    if out.is_relative_to(src):
        raise OutputError(
            f"file {output}: the output folder lies inside the source folder {where}; a resume would read the "
            "output as part of the source. Choose a folder outside the source"
        )
    if src.is_relative_to(out):
        raise OutputError(
            f"file {output}: the source folder {source} lies inside the output folder {where}; --overwrite would "
            "delete it. Move the source out of the output folder, or choose another output folder"
        )
