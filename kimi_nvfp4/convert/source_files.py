"""Which files of the source convert reads and copies, and which it leaves out (and why).

Copied byte for byte: tokenizer files, chat template, generation config, remote code (never imported), the model
card. Only regular files inside the source are read or copied. A symbolic link counts as its target when the
target is a regular file inside the source's own tree (`trusted_root`: the folder itself, or for a Hub download
the repo's cache folder, whose `snapshots/REV/` files are links into `blobs/`); any other link is never followed —
`notes.txt -> /home/me/secret` would publish a secret, `x -> /dev/zero` would fill the disk.

Left out, and listed in the conversion summary:
- links that point outside the source's tree or at something other than a regular file, linked folders, and
  entries that are not regular files (FIFOs, devices, sockets);
- the files convert writes itself (config.json, hf_quant_config.json, the index: not listed);
- kimi-nvfp4's own artifacts (`checkpoint/artifacts.py`): a manifest, an input-scales shard or a validate report in
  a source would otherwise reach our output and be taken for records of stages that never ran on it.
Refused (CheckpointError): config.json, the index or a shard that is not such a regular file, and a `*.safetensors`
file the index does not name — its tensors would silently be missing from the output (engines load what the index
names).
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

from ..checkpoint.artifacts import is_own_artifact
from ..checkpoint.modelopt_config import HF_QUANT_CONFIG_NAME
from ..checkpoint.reader import CONFIG_NAME, INDEX_NAME
from ..errors import CheckpointError

# Written by convert itself from the source's config and the plan.
WRITTEN_BY_CONVERT = frozenset({CONFIG_NAME, HF_QUANT_CONFIG_NAME, INDEX_NAME})
SAFETENSORS_SUFFIX = ".safetensors"


@dataclass(frozen=True)
class SkippedFile:
    path: str  # relative to the source folder, POSIX
    reason: str

    def __str__(self) -> str:
        return f"{self.path} ({self.reason})"


@dataclass
class SourceFiles:
    copy: list[Path]  # relative to the source folder; `real_path` gives the bytes to copy
    skipped: list[SkippedFile]


def _problem(path: Path, trusted_root: Path) -> str | None:
    """Why `path` may not be read as a source file, or None when it is (or links to) a regular file in the tree."""
    try:
        st = os.lstat(path)
    except OSError as e:
        return f"cannot be read ({e.strerror or e})"
    if stat.S_ISREG(st.st_mode):
        return None
    if not stat.S_ISLNK(st.st_mode):
        return "not a regular file"
    target = os.readlink(path)
    real = Path(os.path.realpath(path))
    if not real.is_relative_to(trusted_root):
        return f"a symbolic link to {target}, outside the source; links are not followed"
    if not real.is_file():
        return f"a symbolic link to {target}, which is not a regular file"
    return None


def checked_source_path(root: Path, trusted_root: Path, relative: Path) -> Path:
    """Where the bytes of a source file to copy are (a link's target inside the source's tree), checked again at
    copy time: a link swapped since the plan is refused, not followed."""
    require_regular(root, trusted_root, relative.as_posix(), "source file")
    return Path(os.path.realpath(root / relative))


def require_regular(root: Path, trusted_root: Path, relative: str, what: str) -> None:
    """Refuse a file convert must read (config.json, the index, a shard) unless it is a regular file in the tree."""
    problem = _problem(root / relative, Path(os.path.realpath(trusted_root)))
    if problem is not None:
        raise CheckpointError(f"{what} is {problem}; expected a regular file inside the checkpoint folder",
                              file=root / relative)


def select_source_files(root: Path, shard_files: set[str], trusted_root: Path | None = None) -> SourceFiles:
    """Every entry under `root` that is neither a shard the index names nor hidden, split into copy / skip."""
    trusted = Path(os.path.realpath(trusted_root or root))
    copy: list[Path] = []
    skipped: list[SkippedFile] = []
    for dirpath, dirs, files in os.walk(root, followlinks=False):
        dirs.sort()
        for name in [d for d in dirs if (Path(dirpath) / d).is_symlink()]:
            rel = Path(dirpath, name).relative_to(root)
            if not rel.as_posix().startswith("."):
                skipped.append(SkippedFile(rel.as_posix(), "a symbolic link to a folder; links are not followed"))
        for name in sorted(files):
            rel = Path(dirpath, name).relative_to(root)
            text = rel.as_posix()
            if text in shard_files or text in WRITTEN_BY_CONVERT or text.startswith("."):
                continue
            problem = _problem(root / rel, trusted)
            if problem is not None:
                skipped.append(SkippedFile(text, problem))
                continue
            if is_own_artifact(rel):
                skipped.append(SkippedFile(text, "a kimi-nvfp4 artifact name: only our own stages write it"))
                continue
            if rel.suffix == SAFETENSORS_SUFFIX:
                raise CheckpointError(f"safetensors file that {INDEX_NAME} does not name; its tensors would be "
                                      "missing from the output. Add them to the index or remove the file",
                                      file=root / rel)
            copy.append(rel)
    return SourceFiles(sorted(copy), sorted(skipped, key=lambda s: s.path))
