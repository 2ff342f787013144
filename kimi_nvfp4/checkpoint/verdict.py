"""The validate verdict, sealed to the bytes it judged; and the one check publish applies to it.

validate seals its verdict with the sha256 of every shard the checkpoint's index names (calibrate's
`model-input-scales.safetensors` included) and of every other file publish would upload (config.json,
hf_quant_config.json, the index, tokenizer and chat template, generation config, remote code, any stray file;
`sealed_files`: all but the card publish writes and the report folders), the gate thresholds it applied, and a fingerprint of the
held-out data (the `--data` spec, seed, sample count, sequence length and a sha256 over every token id it
compared). The sealed verdict is stored in the validate report JSON and in the manifest's `stages.validate`.

publish accepts a verdict only from the manifest, and only while the manifest's shard digests (which publish
has just re-verified against the files) and the current load files equal the sealed ones. So a verdict cannot
outlive what it judged: re-running calibrate (new input scales) or convert (new weights) changes a digest, and a
`validate_report.json` lying in the folder — copied from a source, or left by an earlier run — is never read.

Cost: sealing hashes every shard once (read-bound; threads in parallel, like publish's own check).
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Protocol

import torch
from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from ..errors import CheckpointError
from .manifest import MANIFEST_NAME
from .reader import CONFIG_NAME, INDEX_NAME, CheckpointReader
from .writer import sha256_file

VALIDATE_STAGE = "validate"
VERDICT_KEY = "verdict"  # key of the sealed verdict in `stages.validate.outputs` and in validate_report.json
# Files besides the shards that decide how an engine loads the weights (hf_quant_config.json: Model Optimizer's).
LOAD_FILES = (CONFIG_NAME, "hf_quant_config.json", INDEX_NAME)
_HASH_WORKERS = 4
_LENGTH = struct.Struct("<Q")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class DataFingerprint(_Strict):
    """Which held-out tokens the verdict was measured on."""

    spec: str  # the --data spec as given
    seed: int
    samples: int  # asked for
    seq_len: int
    sequences: int  # compared
    tokens: int
    tokens_sha256: str  # over every sequence: its length (u64 LE) then its int64 token ids


class ValidateVerdict(_Strict):
    passed: bool
    failed_gates: list[str]
    shards: dict[str, str]  # shard file -> sha256 of the bytes judged
    load_files: dict[str, str]  # LOAD_FILES present -> sha256
    thresholds: dict[str, Any]  # the gate thresholds applied (validate's GateThresholds)
    thresholds_sha256: str
    data: DataFingerprint
    modes: list[str]
    input_scale_reduction: str
    sealed_at: str

    @model_validator(mode="after")
    def _passed_means_no_failed_gate(self) -> "ValidateVerdict":
        if self.passed and self.failed_gates:
            raise ValueError(f"passed is true but failed_gates lists {self.failed_gates[:5]}: the verdict contradicts "
                             "itself")
        return self


class _Settings(Protocol):
    data: str
    samples: int
    seq_len: int
    seed: int
    modes: list[str]
    input_scale_reduction: str


class JudgedReport(Protocol):
    """What sealing needs from validate's report (validate/report.py `ValidationReport`)."""

    passed: bool
    settings: _Settings
    thresholds: BaseModel

    def failed_gates(self) -> list[Any]: ...


def _digests(root: Path, files: Sequence[str], workers: int) -> dict[str, str]:
    names = sorted(files)
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:  # hashlib releases the GIL
        return dict(zip(names, pool.map(lambda f: sha256_file(root / f), names), strict=True))


def tokens_sha256(sequences: Sequence[torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for seq in sequences:
        ids = seq.detach().reshape(-1).to("cpu", torch.int64).contiguous()
        digest.update(_LENGTH.pack(ids.numel()))
        digest.update(ids.numpy().tobytes())
    return digest.hexdigest()


def _json_sha256(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


# Uploaded but not sealed: the card publish writes itself (README.md; a source card it keeps as README.source.md),
# the manifest (it records the verdict itself; publish re-verifies every shard against it and uploads a public
# copy) and the report folders, whose reports are written after the verdict is sealed.
UNSEALED_NAMES = ("README.md", "README.source.md", MANIFEST_NAME)


def sealed_files(root: Path) -> list[str]:
    """Every file publish would upload from `root` except the index's shards (sealed on their own) and the
    unsealed documentation (UNSEALED_NAMES, report folders): one rule with publish (publish/files.py
    `scan_publish_files`), so a tokenizer, chat template, generation config, remote-code file or stray shard
    added or changed after validate makes the verdict stale."""
    from ..publish.files import CALIBRATION_DIR_NAME, REPORT_DIR_NAME, scan_publish_files

    index = root / INDEX_NAME
    shards: set[str] = set()
    if index.is_file():
        try:
            shards = set((json.loads(index.read_text()).get("weight_map") or {}).values())
        except (json.JSONDecodeError, AttributeError):
            shards = set()  # a malformed index is itself sealed (and judged by the reader elsewhere)
    return [f.path for f in scan_publish_files(root)[0]
            if f.path not in shards and f.path not in UNSEALED_NAMES
            and f.path.split("/", 1)[0] not in (REPORT_DIR_NAME, CALIBRATION_DIR_NAME)]


def load_file_digests(root: Path) -> dict[str, str]:
    """sha256 of every sealed file (`sealed_files`: config.json, hf_quant_config.json and the index among them)."""
    return {name: sha256_file(root / name) for name in sealed_files(Path(root))}


def seal_verdict(
    checkpoint: str | Path, report: JudgedReport, sequences: Sequence[torch.Tensor], *, workers: int = _HASH_WORKERS
) -> ValidateVerdict:
    """The verdict of `report` bound to the checkpoint's current bytes and to the held-out `sequences`."""
    root = Path(checkpoint)
    shards = CheckpointReader(root).shard_files
    thresholds = report.thresholds.model_dump(mode="json")
    s = report.settings
    return ValidateVerdict(
        passed=report.passed,
        failed_gates=[g.name for g in report.failed_gates()],
        shards=_digests(root, shards, workers),
        load_files=load_file_digests(root),
        thresholds=thresholds,
        thresholds_sha256=_json_sha256(thresholds),
        data=DataFingerprint(
            spec=s.data, seed=s.seed, samples=s.samples, seq_len=s.seq_len, sequences=len(sequences),
            tokens=sum(int(q.numel()) for q in sequences), tokens_sha256=tokens_sha256(sequences),
        ),
        modes=list(s.modes),
        input_scale_reduction=s.input_scale_reduction,
        sealed_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
    )


@dataclass(frozen=True)
class VerdictCheck:
    """What publish found: `passed` None when there is no sealed verdict, else whether it holds and passed."""

    passed: bool | None
    problem: str | None  # why the verdict does not count (absent, stale, failed); None when it holds and passed
    verdict: ValidateVerdict | None
    source: str  # where it was read from


def _stale(verdict: ValidateVerdict, recorded: dict[str, str], current_load_files: Callable[[], dict[str, str]]) -> str | None:
    if set(verdict.shards) != set(recorded):
        added = sorted(set(recorded) - set(verdict.shards))
        gone = sorted(set(verdict.shards) - set(recorded))
        what = "; ".join(x for x in (f"new shards {added}" if added else "", f"shards gone {gone}" if gone else "") if x)
        return f"the verdict judged other shards ({what})"
    changed = sorted(f for f, digest in verdict.shards.items() if recorded[f] != digest)
    if changed:
        return f"shard(s) changed since validate judged them: {', '.join(changed)}"
    now = current_load_files()
    changed = sorted(f for f in set(verdict.load_files) | set(now) if verdict.load_files.get(f) != now.get(f))
    if changed:
        return f"file(s) changed since validate judged them: {', '.join(changed)}"
    return None


def check_verdict(root: str | Path, manifest: Any) -> VerdictCheck:
    """The sealed verdict in `manifest.stages["validate"]`, checked against the manifest's shard digests (which the
    caller has verified against the files) and the folder's current load files. Never reads a report file."""
    root = Path(root)
    source = f"{MANIFEST_NAME} stages.{VALIDATE_STAGE}.outputs.{VERDICT_KEY}"
    record = manifest.stages.get(VALIDATE_STAGE)
    if record is None:
        return VerdictCheck(None, "validate has not run on these bytes (no stages.validate in the manifest)", None, source)
    if not record.complete:
        return VerdictCheck(False, "validate did not finish (stages.validate is not complete)", None, source)
    raw = record.outputs.get(VERDICT_KEY)
    if raw is None:
        return VerdictCheck(None, "stages.validate carries no sealed verdict (written by an older kimi-nvfp4, or by "
                                  "hand); run validate again", None, source)
    try:
        verdict = ValidateVerdict.model_validate(raw)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ())) or "verdict"
        raise CheckpointError(f"stages.validate verdict is malformed ({where}: {first.get('msg')})",
                              file=root / MANIFEST_NAME) from None
    recorded = {f: r.sha256 for f, r in manifest.shards.items()}
    stale = _stale(verdict, recorded, lambda: load_file_digests(root))
    if stale is not None:
        return VerdictCheck(None, f"the validate verdict is stale: {stale}; run validate again", verdict, source)
    if not verdict.passed:
        failed = ", ".join(verdict.failed_gates[:8]) or "see the validate report"
        return VerdictCheck(False, f"validate did not pass (failed gates: {failed})", verdict, source)
    return VerdictCheck(True, None, verdict, source)
