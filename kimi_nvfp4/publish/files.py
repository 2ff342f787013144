"""Which files of a converted folder get published, and how big they are.

The same list feeds `--dry-run`, the readiness checks and the upload (passed to huggingface_hub as exact
`allow_patterns`), so what the dry run shows is exactly what is uploaded.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

# Never uploaded: half-written outputs (`.NAME.partial`, see docs/design.md "Common rules"), hidden files and
# folders (huggingface_hub keeps its resumable-upload state under `.cache/huggingface/`), and editor/OS debris.
PARTIAL_SUFFIX = ".partial"
# Characters that fnmatch treats as wildcards: a file named with them could not be passed as an exact pattern.
GLOB_CHARACTERS = frozenset("*?[]")
CARD_NAME = "README.md"
# Stage reports are published for the card to link (JSON, Markdown, PNG charts); bulky by-products under the
# report folder (calibrate's per-layer activation statistics, server logs) stay local.
REPORT_DIR_NAME = "reports"
PUBLISHED_REPORT_SUFFIXES = frozenset({".json", ".md", ".png"})
# The source's own model card, kept beside ours when publish writes README.md (attribution, license text).
SOURCE_CARD_NAME = "README.source.md"


@dataclass(frozen=True)
class PublishFile:
    """One file that will be uploaded: its path relative to the folder (POSIX) and its size in bytes."""

    path: str
    bytes: int

    def to_dict(self) -> dict:
        return asdict(self)


def is_published(relative: Path) -> bool:
    """True if a file at this relative path belongs in the upload."""
    if any(part.startswith(".") for part in relative.parts):
        return False
    if relative.parts[0] == REPORT_DIR_NAME and relative.suffix not in PUBLISHED_REPORT_SUFFIXES:
        return False
    return not relative.name.endswith(PARTIAL_SUFFIX)


def partial_files(folder: Path) -> list[str]:
    """Half-written outputs left in the folder (a stage still running, or one that crashed)."""
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob(f"*{PARTIAL_SUFFIX}") if p.is_file())


def list_publish_files(folder: str | Path) -> list[PublishFile]:
    """Every file that `publish` uploads from `folder`, sorted by path."""
    root = Path(folder)
    files = []
    for path in sorted(root.rglob("*")):
        if not path.is_file():
            continue
        relative = path.relative_to(root)
        if is_published(relative):
            files.append(PublishFile(relative.as_posix(), path.stat().st_size))
    return files


def format_size(n: int) -> str:
    """Human-readable size with binary prefixes (the Hub and `du -h` use the same)."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.2f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")
