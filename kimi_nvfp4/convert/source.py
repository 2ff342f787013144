"""Where the source checkpoint is: a local folder, or a Hugging Face Hub repo id downloaded first.

A fingerprint of the source lets a re-run tell "same source, resume" from "different source,
refuse": config.json bytes, every tensor's name, shard, dtype and shape (headers), and the bytes of
every tensor of at most one dimension (norms, router biases, weight_shape: a few MB for K2.6), so
two checkpoints with one layout but different weights (another fine-tune, another seed) differ.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from ..checkpoint.manifest import SourceRecord
from ..checkpoint.reader import CONFIG_NAME
from ..checkpoint.tensor_io import ShardFiles
from ..errors import CheckpointError
from .plan import ConversionPlan

# `org/name` as the Hub spells repo ids (https://huggingface.co/docs/hub/repositories).
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
# Weights and the files a serving engine reads; nothing else is downloaded.
# huggingface_hub's cache layout: models--ORG--NAME/{snapshots/REV/FILE -> ../../blobs/HASH, blobs/HASH}.
_HUB_SNAPSHOTS = "snapshots"
HUB_ALLOW_PATTERNS = ["*.safetensors", "*.json", "*.jinja", "*.model", "*.py", "*.txt", "*.md", "*.tiktoken"]


@dataclass(frozen=True)
class ResolvedSource:
    path: Path
    repo_id: str | None = None
    revision: str | None = None
    # The tree the source's files may link into (convert/source_files.py): the folder itself, or for a Hub download
    # the repo's cache folder (huggingface_hub's `snapshots/REV/NAME` are links to `../../blobs/HASH`).
    trusted_root: Path | None = None


def resolve_source(source: str | Path, revision: str | None = None) -> ResolvedSource:
    """A local folder is used as is; an `org/name` that is not a folder is downloaded from the Hub."""
    path = Path(source).expanduser()
    if path.is_dir():
        return ResolvedSource(path.resolve(), trusted_root=path.resolve())
    text = str(source)
    if not _REPO_ID.match(text):
        raise CheckpointError("source is neither a checkpoint folder nor a Hub repo id (org/name)", file=text)
    try:
        from huggingface_hub import snapshot_download
    except ImportError as e:  # pragma: no cover - huggingface_hub is a dependency
        raise CheckpointError(f"cannot download from the Hub ({e})", file=text) from None
    try:
        local = snapshot_download(text, revision=revision, allow_patterns=HUB_ALLOW_PATTERNS)
    except Exception as e:  # noqa: BLE001 - the hub client raises many types (network, auth, not found)
        raise CheckpointError(f"cannot download from the Hub ({type(e).__name__}: {e})", file=text) from None
    local_path = Path(local)
    cache_repo = local_path.parent.parent if local_path.parent.name == _HUB_SNAPSHOTS else local_path
    return ResolvedSource(local_path, repo_id=text, revision=revision, trusted_root=cache_repo)


def source_fingerprint(plan: ConversionPlan) -> str:
    digest = hashlib.sha256((plan.root / CONFIG_NAME).read_bytes())
    with ShardFiles(plan.root) as files:
        for job in plan.jobs:
            entries = [(t.name, t.file, str(t.dtype), list(t.shape)) for t in job.passthrough]
            entries += [
                (m.module, m.packed.file, m.scale.file, m.out_features, m.in_features)
                for g in job.groups
                for m in g.matrices
            ]
            digest.update(json.dumps([job.file, entries]).encode())
            for t in job.passthrough:
                if len(t.shape) <= 1:
                    digest.update(files.read(t.file, t.name).reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def source_record(resolved: ResolvedSource, plan: ConversionPlan) -> SourceRecord:
    return SourceRecord(
        path=str(resolved.path), repo_id=resolved.repo_id, revision=resolved.revision, fingerprint=source_fingerprint(plan)
    )
