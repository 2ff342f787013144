"""What the Hub receives is what a reader needs, not the uploader's file system.

The manifest and the stage reports carry facts that only help a resume on this machine: absolute paths (the
source folder, the output folder, report folders, the home folder) and the Linux boot id. publish uploads public
copies of our own artifacts (`checkpoint/artifacts.py`: the manifest, `reports/`, `calibration/`, every stage
report), in which
- the manifest's `source.path` becomes the Hub repo id (or the folder's name) and its `boot_id` is dropped;
- every string that mentions the output folder, the source folder or the home folder has that prefix replaced
  (`.`, `<source>`, `~`), and any other absolute path that exists on this machine becomes `<local>/NAME`;
- the boot id, wherever it appears, becomes `<boot id>`.
The local files are never changed: resume information stays where it is used. Every other file is uploaded as is.

The upload reads from `OUTPUT/.kimi_nvfp4_upload/` (hidden, so never listed itself): hard links to the files to
upload (same inode, so the bytes publish just verified, without a copy) and the public copies. huggingface_hub keeps
its resumable-upload state under that folder's `.cache/`, which survives between runs.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path, PurePath

from ..checkpoint.artifacts import is_own_artifact
from ..checkpoint.manifest import MANIFEST_NAME, ConversionManifest, current_boot_id
from ..errors import OutputError
from .files import PublishFile

UPLOAD_DIR_NAME = ".kimi_nvfp4_upload"
_HUB_STATE_DIR = ".cache"  # huggingface_hub's resumable-upload state inside the uploaded folder: kept
_TEXT_SUFFIXES = frozenset({".json", ".md"})
SOURCE_PLACEHOLDER = "<source>"
LOCAL_PLACEHOLDER = "<local>"
BOOT_ID_PLACEHOLDER = "<boot id>"
# An absolute POSIX path inside a longer string (stops at whitespace, quotes and the punctuation around paths).
_ABSOLUTE_PATH = re.compile(r"(?<![\w.~<>-])/[^\s'\"`,;:()\[\]{}<>|]+")


@dataclass(frozen=True)
class LocalFacts:
    """What a public copy must not reveal, and what to write instead."""

    prefixes: tuple[tuple[str, str], ...]  # (local folder, placeholder), longest first
    boot_ids: tuple[str, ...]
    source_label: str

    @classmethod
    def of(cls, root: Path, manifest: ConversionManifest | None) -> LocalFacts:
        pairs: dict[str, str] = {}
        source_label = SOURCE_PLACEHOLDER
        if manifest is not None:
            source_label = manifest.source.repo_id or Path(manifest.source.path).name or SOURCE_PLACEHOLDER
            for form in {manifest.source.path, os.path.realpath(manifest.source.path)}:
                if form and os.path.isabs(form):
                    pairs[form.rstrip("/")] = SOURCE_PLACEHOLDER
        for form in {str(root.absolute()), os.path.realpath(root)}:
            pairs[form.rstrip("/")] = "."
        home = os.path.expanduser("~")
        if home not in ("/", "~", ""):
            pairs.setdefault(home.rstrip("/"), "~")
        prefixes = tuple(sorted(((p, r) for p, r in pairs.items() if p), key=lambda pr: -len(pr[0])))
        boots = {b for b in (current_boot_id(), manifest.boot_id if manifest is not None else None) if b}
        return cls(prefixes, tuple(sorted(boots)), source_label)

    def text(self, value: str) -> str:
        """`value` with local folders, other existing local paths and boot ids replaced."""
        for boot in self.boot_ids:
            value = value.replace(boot, BOOT_ID_PLACEHOLDER)
        for prefix, replacement in self.prefixes:
            # The folder itself or a path below it; `/tmp/out2` is not below `/tmp/out`.
            value = re.sub(re.escape(prefix) + r"(?=/|$|[^\w.-])", lambda _m: replacement, value)

        def other(match: re.Match[str]) -> str:
            path = match.group(0)
            return f"{LOCAL_PLACEHOLDER}/{PurePath(path).name}" if os.path.lexists(path) else path

        return _ABSOLUTE_PATH.sub(other, value)

    def json_value(self, value):
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, list):
            return [self.json_value(v) for v in value]
        if isinstance(value, dict):
            return {self.text(k): self.json_value(v) for k, v in value.items()}
        return value


def public_manifest(manifest: ConversionManifest, facts: LocalFacts) -> bytes:
    data = manifest.model_dump(mode="json")
    data["source"]["path"] = facts.source_label
    data["boot_id"] = None
    return (json.dumps(facts.json_value(data), indent=2) + "\n").encode()


def public_bytes(root: Path, relative: str, facts: LocalFacts, manifest: ConversionManifest | None) -> bytes | None:
    """The public copy of one file to upload, or None when it is uploaded as is (not ours, or nothing to hide)."""
    rel = PurePath(relative)
    if not is_own_artifact(rel) or rel.suffix not in _TEXT_SUFFIXES:
        return None
    if relative == MANIFEST_NAME and manifest is not None:
        return public_manifest(manifest, facts)
    raw = (root / relative).read_bytes()
    if rel.suffix == ".json":
        try:
            data = json.loads(raw)
        except ValueError:
            data = None
        if data is not None:
            public = facts.json_value(data)
            return None if public == data else (json.dumps(public, indent=2, ensure_ascii=False) + "\n").encode()
    text = raw.decode("utf-8", errors="replace")
    public_text = facts.text(text)
    return None if public_text == text else public_text.encode()


def public_sizes(root: Path, files: list[PublishFile], manifest: ConversionManifest | None) -> list[PublishFile]:
    """`files` with the sizes of what is uploaded (public copies are smaller or larger than the local files)."""
    facts = LocalFacts.of(root, manifest)
    out = []
    for f in files:
        data = public_bytes(root, f.path, facts, manifest) if (root / f.path).is_file() else None
        out.append(PublishFile(f.path, len(data)) if data is not None else f)
    return out


def stage_upload(root: Path, files: list[PublishFile], manifest: ConversionManifest | None) -> Path:
    """Build `root/UPLOAD_DIR_NAME` holding exactly `files`: public copies of our artifacts, hard links to the rest."""
    facts = LocalFacts.of(root, manifest)
    staging = root / UPLOAD_DIR_NAME
    try:
        staging.mkdir(exist_ok=True)
        for entry in staging.iterdir():
            if entry.name == _HUB_STATE_DIR:
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
        for f in files:
            dst = staging / f.path
            dst.parent.mkdir(parents=True, exist_ok=True)
            data = public_bytes(root, f.path, facts, manifest)
            if data is not None:
                dst.write_bytes(data)
                continue
            try:
                os.link(root / f.path, dst)
            except OSError:  # a file system without hard links: the upload reads the verified file through a link
                dst.symlink_to(os.path.realpath(root / f.path))
    except OSError as e:
        raise OutputError(f"file {staging}: cannot prepare the upload ({e.strerror or e})") from None
    return staging
