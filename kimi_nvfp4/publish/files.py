"""Which files of a converted folder get published, and how big they are.

The same list feeds `--dry-run`, the readiness checks and the upload (passed to huggingface_hub as exact
`allow_patterns`), so what the dry run shows is exactly what is uploaded. Only regular files are listed: symbolic
links (and devices, sockets, FIFOs) are left out and named in the notes, and a linked folder is never entered.
"""

from __future__ import annotations

import os
import stat
from dataclasses import asdict, dataclass
from pathlib import Path

from ..data.errors import DataError

# Never uploaded: half-written outputs (`.NAME.partial`, see docs/design.md "Common rules"), hidden files and
# folders (huggingface_hub keeps its resumable-upload state under `.cache/huggingface/`), and editor/OS debris.
PARTIAL_SUFFIX = ".partial"
# Characters that fnmatch treats as wildcards: a file named with them could not be passed as an exact pattern.
GLOB_CHARACTERS = frozenset("*?[]")
CARD_NAME = "README.md"
# Stage reports are published for the card to link (JSON, Markdown, PNG charts); bulky by-products under the
# report folders (calibrate's per-layer activation statistics and expert statistics -- dense Hessians, ~85 GB a
# layer at K2.6 size -- server logs) stay local.
REPORT_DIR_NAME = "reports"
CALIBRATION_DIR_NAME = "calibration"  # calibrate's default report folder, and always its expert statistics
PUBLISHED_REPORT_SUFFIXES = frozenset({".json", ".md", ".png"})
# Files that hold users' traffic (request dumps, request logs, session and window exports): never uploaded; a
# folder holding one is refused, so a data folder cannot be published by mistake (privacy, docs/data.md).
DATA_SUFFIXES = frozenset({".pkl", ".pickle", ".jsonl", ".log"})
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
    in_report_folder = relative.parts[0] in (REPORT_DIR_NAME, CALIBRATION_DIR_NAME)
    if in_report_folder and relative.suffix not in PUBLISHED_REPORT_SUFFIXES:
        return False
    return not relative.name.endswith(PARTIAL_SUFFIX)


def _walk(root: Path):
    """(relative path, lstat result) of every entry under `root`, never following a symbolic link (a linked folder
    is reported, not entered)."""
    for dirpath, dirs, names in os.walk(root, followlinks=False):
        for name in sorted(dirs) + sorted(names):
            path = Path(dirpath, name)
            try:
                st = os.lstat(path)
            except OSError:
                continue  # removed meanwhile
            if name in dirs and not stat.S_ISLNK(st.st_mode):
                continue  # a real folder: walked into
            yield path.relative_to(root), st
        dirs.sort()


def partial_files(folder: Path) -> list[str]:
    """Half-written outputs left in the folder (a stage still running, or one that crashed)."""
    return sorted(rel.as_posix() for rel, st in _walk(folder)
                  if stat.S_ISREG(st.st_mode) and rel.name.endswith(PARTIAL_SUFFIX))


@dataclass(frozen=True)
class LeftOut:
    """A visible entry of the folder that is not uploaded because it is not a regular file."""

    path: str
    reason: str

    def __str__(self) -> str:
        return f"{self.path} ({self.reason})"


def scan_publish_files(folder: str | Path) -> tuple[list[PublishFile], list[LeftOut]]:
    """The files `publish` uploads from `folder` (regular files only, sorted by path), and the visible entries it
    leaves out because they are links or not regular files: a link is never followed, so a `notes.txt` pointing at
    a local secret, or a file pointing at /dev/zero, never reaches the Hub."""
    root = Path(folder)
    files, left_out = [], []
    for relative, st in _walk(root):
        if not is_published(relative):
            continue
        if stat.S_ISLNK(st.st_mode):
            target = os.readlink(root / relative)
            left_out.append(LeftOut(relative.as_posix(), f"a symbolic link (to {target}); links are not uploaded"))
        elif not stat.S_ISREG(st.st_mode):
            left_out.append(LeftOut(relative.as_posix(), "not a regular file"))
        else:
            files.append(PublishFile(relative.as_posix(), st.st_size))
    data = [f.path for f in files if Path(f.path).suffix in DATA_SUFFIXES or ".log." in Path(f.path).name]
    if data:
        raise DataError(f"publish refuses to upload data ({', '.join(sorted(data)[:5])}"
                        f"{', ...' if len(data) > 5 else ''}): request dumps, logs and session files hold users' "
                        "prompts; move them out of the folder", file=root)
    files.sort(key=lambda f: tuple(f.path.split("/")))
    left_out.sort(key=lambda f: tuple(f.path.split("/")))
    return files, left_out


def list_publish_files(folder: str | Path) -> list[PublishFile]:
    """Every file that `publish` uploads from `folder`, sorted by path."""
    return scan_publish_files(folder)[0]


def format_size(n: int) -> str:
    """Human-readable size with binary prefixes (the Hub and `du -h` use the same)."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.2f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")
