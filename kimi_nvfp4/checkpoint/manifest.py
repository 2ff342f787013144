"""`kimi_nvfp4_manifest.json`: what produced a converted checkpoint, and how far each stage got.

Convert records its settings, every finished shard with its sha256 (so a re-run resumes and
skips them), and per-matrix error statistics. Later stages add `stages[name]` records.
Only device-independent settings are recorded: CPU and GPU produce the same bytes, so switching
`--device` or `--workers` must not invalidate finished shards.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .. import __version__
from ..errors import CheckpointError
from .writer import write_bytes_atomic

MANIFEST_NAME = "kimi_nvfp4_manifest.json"
MANIFEST_FORMAT_VERSION = 1


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SourceRecord(_Strict):
    path: str  # local folder the checkpoint was read from
    repo_id: str | None = None  # Hub repo id, when the source was given as one
    revision: str | None = None
    # sha256 over config.json and every tensor's name/shard/dtype/shape: same source => same fingerprint
    fingerprint: str = ""


class ConversionSettings(_Strict):
    """Settings that change output bytes. Equal settings => a finished shard can be reused."""

    method: str
    kv_cache_quant_algo: str | None
    quant_algo: str = "NVFP4"
    group_size: int = 16
    # `convert --shared-experts` and its block-scale rule (added later: an older manifest means bf16)
    shared_experts: str = "bf16"
    shared_expert_scales: str = "amax"
    # the scale method's typed options where it has any (`convert --method-option`; none of the weight-only methods
    # takes any yet, so this is empty and left out of the digest)
    method_options: dict[str, Any] = Field(default_factory=dict)


# Settings added after manifests were first written: left out of the digest at these values, so shards an older
# version converted (with what these defaults describe) are still reused by a resume.
_DIGEST_OMITS_AT = {"shared_experts": "bf16", "shared_expert_scales": "amax", "method_options": {}}


class ShardRecord(_Strict):
    file: str
    sha256: str
    bytes: int
    tensors: int
    # False when written without fsync (`convert --no-fsync`): trusted on resume only within the same boot
    # (`ConversionManifest.boot_id`); after a reboot its sha256 is checked first (convert/output.py).
    durable: bool = True
    # `conversion_sha256` of the settings and source that wrote this shard: a resume reuses the shard only for the
    # same digest (None: a shard kimi-nvfp4 did not convert, e.g. calibrate's input scales, or an older manifest).
    settings_sha256: str | None = None


class StageRecord(_Strict):
    settings: dict[str, Any] = Field(default_factory=dict)
    complete: bool = False
    finished_at: str = ""
    outputs: dict[str, Any] = Field(default_factory=dict)


class ConversionManifest(_Strict):
    format_version: int = MANIFEST_FORMAT_VERSION
    tool_version: str = __version__
    source: SourceRecord
    settings: ConversionSettings
    shards: dict[str, ShardRecord] = Field(default_factory=dict)
    complete: bool = False
    tensor_stats: dict[str, dict[str, Any]] = Field(default_factory=dict)
    stages: dict[str, StageRecord] = Field(default_factory=dict)
    boot_id: str | None = None  # the OS boot of the last convert run (`current_boot_id`)


def conversion_sha256(settings: ConversionSettings, source_fingerprint: str) -> str:
    """What decides a converted shard's bytes: the settings and the source (its fingerprint)."""
    fields = settings.model_dump(mode="json")
    fields = {k: v for k, v in fields.items() if _DIGEST_OMITS_AT.get(k, object()) != v}
    payload = json.dumps({"settings": fields, "source": source_fingerprint}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()


_BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def current_boot_id() -> str | None:
    """Linux's id of the running boot: unchanged across process crashes, new after an OS crash or reboot, which
    is what can lose bytes written without fsync. None where the OS does not provide one."""
    try:
        return _BOOT_ID.read_text().strip() or None
    except OSError:
        return None


def load_manifest(directory: str | Path) -> ConversionManifest:
    path = Path(directory) / MANIFEST_NAME
    if not path.is_file():
        raise CheckpointError("manifest is missing (not a kimi-nvfp4 conversion output?)", file=path)
    try:
        return ConversionManifest.model_validate_json(path.read_text())
    except (ValidationError, ValueError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise CheckpointError(f"manifest is malformed ({first})", file=path) from None


def save_manifest(directory: str | Path, manifest: ConversionManifest, *, durable: bool = True) -> Path:
    """Write atomically (temporary name, fsync unless not `durable`, rename).

    Shards and tensor statistics are written in name order: with `--workers N` jobs finish in any order, and the
    manifest's bytes must not depend on which finished first."""
    path = Path(directory) / MANIFEST_NAME
    data = manifest.model_dump(mode="json")
    for key in ("shards", "tensor_stats"):
        data[key] = dict(sorted(data[key].items()))
    text = json.dumps(data, indent=2, sort_keys=False) + "\n"
    write_bytes_atomic(path, text.encode(), durable=durable)
    return path
