"""Which non-weight files of the source convert copies into the output, and which it leaves out (and why).

Copied byte for byte: tokenizer files, chat template, generation config, remote code (never imported), the model
card. Left out, and listed in the conversion summary:
- the files convert writes itself (config.json, hf_quant_config.json, the index);
- kimi-nvfp4's own artifacts (`checkpoint/artifacts.py`): a manifest, an input-scales shard or a validate report in
  a source would otherwise reach our output and be taken for records of stages that never ran on it.
Refused: a `*.safetensors` file the index does not name — its tensors would silently be missing from the output
(engines load what the index names).
"""

from __future__ import annotations

import os
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
    copy: list[Path]  # relative to the source folder
    skipped: list[SkippedFile]


def select_source_files(root: Path, shard_files: set[str]) -> SourceFiles:
    """Every file under `root` that is neither a shard the index names nor hidden, split into copy / skip."""
    copy: list[Path] = []
    skipped: list[SkippedFile] = []
    for dirpath, dirs, files in os.walk(root):
        dirs.sort()
        for name in sorted(files):
            rel = Path(dirpath, name).relative_to(root)
            text = rel.as_posix()
            if text in shard_files or text in WRITTEN_BY_CONVERT or text.startswith("."):
                continue
            if is_own_artifact(rel):
                skipped.append(SkippedFile(text, "a kimi-nvfp4 artifact name: only our own stages write it"))
                continue
            if rel.suffix == SAFETENSORS_SUFFIX:
                raise CheckpointError(f"safetensors file that {INDEX_NAME} does not name; its tensors would be "
                                      "missing from the output. Add them to the index or remove the file",
                                      file=root / rel)
            copy.append(rel)
    return SourceFiles(sorted(copy), skipped)
