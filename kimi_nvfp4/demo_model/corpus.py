"""Training text for the tiny model: the Python standard library's source, split by file hash.

The stdlib is on every machine with Python, so the corpus needs no download. A file goes to the
held-out split when the first bytes of sha256(relative path) fall under `heldout_fraction`: the
split depends on the path only, never on file order, the machine, or the random seed. Held-out
files are never seen in training (neither as plain code nor inside a rendered chat).
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

# Sub-trees that are not Python source worth learning: bundled third-party packages, bytecode,
# wheels, generated charmap tables (`encodings`) and test fixtures (`data`: Python 2 files, bad syntax).
# The stdlib's own test suite stays in: it is real code and triples the corpus.
EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "ensurepip", "encodings", "data"})
DEFAULT_HELDOUT_FRACTION = 0.05
# Larger files are generated tables (unicode data, pydoc topics), not code worth learning.
MAX_FILE_BYTES = 200_000
_HASH_SPAN = 2**32


@dataclass(frozen=True)
class SourceFile:
    relpath: str  # posix path relative to the corpus root, e.g. "json/decoder.py"
    text: str


@dataclass(frozen=True)
class CorpusSplit:
    root: str
    train: tuple[SourceFile, ...]
    heldout: tuple[SourceFile, ...]

    @property
    def train_chars(self) -> int:
        return sum(len(f.text) for f in self.train)

    @property
    def heldout_chars(self) -> int:
        return sum(len(f.text) for f in self.heldout)


def default_source_root() -> Path:
    """The running interpreter's standard library folder."""
    return Path(sysconfig.get_paths()["stdlib"])


def is_heldout(relpath: str, heldout_fraction: float) -> bool:
    digest = hashlib.sha256(relpath.encode("utf-8")).digest()
    return int.from_bytes(digest[:4], "big") < heldout_fraction * _HASH_SPAN


def _is_excluded(rel: Path) -> bool:
    return any(p in EXCLUDED_DIRS for p in rel.parts[:-1])


def load_corpus(root: Path | None = None, *, heldout_fraction: float = DEFAULT_HELDOUT_FRACTION) -> CorpusSplit:
    """Every `.py` file under `root` (sorted by path, excluded folders skipped), split in two."""
    root = Path(root) if root is not None else default_source_root()
    if not root.is_dir():
        raise FileNotFoundError(f"corpus root {root} is not a folder of Python source")
    train: list[SourceFile] = []
    heldout: list[SourceFile] = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if _is_excluded(rel) or not path.is_file() or path.stat().st_size > MAX_FILE_BYTES:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # a few stdlib files carry latin-1 test data; they are not code we want
        if not text.strip():
            continue
        item = SourceFile(rel.as_posix(), text)
        (heldout if is_heldout(item.relpath, heldout_fraction) else train).append(item)
    if not train or not heldout:
        raise ValueError(f"corpus root {root}: need files in both splits, "
                         f"got {len(train)} train / {len(heldout)} held out")
    return CorpusSplit(str(root), tuple(train), tuple(heldout))
