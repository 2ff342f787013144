"""`publish_checkpoint`: check, write the model card, upload — or, with `dry_run`, only show what would happen."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from ..checkpoint.manifest import StageRecord, load_manifest, save_manifest
from ..stage_kit.output_paths import require_writable_dir
from ..checkpoint.output_lock import output_lock
from ..checkpoint.writer import write_bytes_atomic
from ..errors import KimiNvfp4Error, OutputError
from .card import GENERATED_MARKER, build_model_card
from .checks import Readiness, check_publishable
from .files import CARD_NAME, SOURCE_CARD_NAME, PublishFile, format_size, list_publish_files, scan_publish_files
from .options import PublishOptions
from .public_copy import public_sizes, stage_upload
from .reports import ReportSet
from .upload import UploadResult, resolved_endpoint, upload_to_hub

PUBLISH_STAGE = "publish"


@dataclass
class PublishResult:
    repo_id: str
    dry_run: bool
    files: list[PublishFile]
    total_bytes: int
    card: str
    readiness: Readiness
    endpoint: str
    upload: UploadResult | None = None
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        data = asdict(self)
        data["card_sha256"] = hashlib.sha256(self.card.encode()).hexdigest()
        del data["card"]
        return data

    def render_dry_run(self) -> str:
        """The `--dry-run` listing: every file with its size, the total, then the card."""
        width = max((len(f.path) for f in self.files), default=4)
        lines = [f"dry run: would upload {len(self.files)} files ({format_size(self.total_bytes)}) to "
                 f"{self.repo_id} at {self.endpoint} (no network used)", ""]
        lines += [f"  {f.path:<{width}}  {format_size(f.bytes):>12}" for f in self.files]
        lines += ["", f"  {'total':<{width}}  {format_size(self.total_bytes):>12}", ""]
        lines += [f"note: {n}" for n in self.notes + self.readiness.notes]
        lines += [f"----- {CARD_NAME} -----", self.card.rstrip(), f"----- end of {CARD_NAME} -----"]
        return "\n".join(lines)


def _planned_files(root: Path, card: str) -> list[PublishFile]:
    """The upload list as it will be once the card is written (README.md replaced, source card kept aside)."""
    files = {f.path: f for f in list_publish_files(root)}
    readme = root / CARD_NAME
    if readme.is_file() and GENERATED_MARKER not in readme.read_text(encoding="utf-8", errors="replace") \
            and SOURCE_CARD_NAME not in files:
        files[SOURCE_CARD_NAME] = PublishFile(SOURCE_CARD_NAME, readme.stat().st_size)
    files[CARD_NAME] = PublishFile(CARD_NAME, len(card.encode("utf-8")))
    return [files[k] for k in sorted(files)]


def _install_card(root: Path, card: str) -> None:
    """Write README.md; a README.md that is the source's card is first kept as README.source.md."""
    readme = root / CARD_NAME
    if readme.is_file() and GENERATED_MARKER not in readme.read_text(encoding="utf-8", errors="replace") \
            and not (root / SOURCE_CARD_NAME).exists():
        try:
            os.replace(readme, root / SOURCE_CARD_NAME)
        except OSError as e:
            raise OutputError(f"file {readme}: cannot keep the source card as {SOURCE_CARD_NAME} "
                              f"({e.strerror or e})") from None
    write_bytes_atomic(readme, card.encode("utf-8"))


def check_repo_id(repo_id: str) -> None:
    """`namespace/name` as the Hub accepts it (checked before hashing hundreds of GB)."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as e:
        raise KimiNvfp4Error(f"invalid Hub repo id {repo_id!r}: {e}") from None
    if "/" not in repo_id:
        raise KimiNvfp4Error(f"invalid Hub repo id {repo_id!r}: expected NAMESPACE/NAME")


def publish_checkpoint(
    output: str | Path,
    repo_id: str,
    options: PublishOptions | None = None,
    *,
    report_dir: str | Path | None = None,
    progress: bool = True,
    **overrides: Any,
) -> PublishResult:
    """Refuse unless `output` is complete, intact and validated; build the card; upload unless `dry_run`.

    Raises CheckpointError (incomplete manifest, bad shard), GateFailure (validate missing/failed without
    `force_unvalidated`), HubAuthError (no token), OutputError (the Hub refused).
    A dry run writes nothing and uses no network; a real run writes README.md and records `stages["publish"]`.

    :param options: a `PublishOptions` (publish/options.py: private, revision, dry_run, force_unvalidated,
        base_model, endpoint, workers); its fields may also be given as keywords.
    :param report_dir: where validate/serve-check wrote their reports (default: OUTPUT/reports, then the manifest).
    """
    opts = PublishOptions.build(options, overrides, "publish_checkpoint")
    dry_run = opts.dry_run
    root = Path(output)
    check_repo_id(repo_id)
    # A real publish writes README.md and the manifest, and uploads what it verified: nothing else may write into
    # the folder meanwhile. A dry run writes nothing, not even the lock file.
    with output_lock(root, "publish", create=False) if not dry_run else contextlib.nullcontext():
        return _publish_locked(root, repo_id, opts, report_dir=report_dir, progress=progress)


def _publish_locked(
    root: Path, repo_id: str, opts: PublishOptions, *, report_dir: str | Path | None, progress: bool
) -> PublishResult:
    private, revision, dry_run, endpoint = opts.private, opts.revision, opts.dry_run, opts.endpoint
    if not dry_run:  # README.md and the manifest are written after the upload: refuse before it instead
        require_writable_dir(root, what="the checkpoint folder (publish writes README.md and the manifest)")
    readiness = check_publishable(root, force_unvalidated=opts.force_unvalidated, workers=opts.workers,
                                  progress=progress)
    reports = ReportSet.find(root, report_dir)
    card = build_model_card(root, repo_id, readiness, reports=reports, base_model=opts.base_model)
    manifest = load_manifest(root)
    files = public_sizes(root, _planned_files(root, card), manifest)
    result = PublishResult(repo_id, dry_run, files, sum(f.bytes for f in files), card, readiness,
                           resolved_endpoint(endpoint))
    result.notes += [f"not uploaded: {left}" for left in scan_publish_files(root)[1]]
    if reports.serve_check_chart is not None and not reports.serve_check_chart.resolve().is_relative_to(root.resolve()):
        result.notes.append(f"serve-check chart {reports.serve_check_chart} is outside {root}; not uploaded")
    if dry_run:
        return result
    _install_card(root, card)
    result.files = public_sizes(root, _planned_files(root, card), manifest)
    # Upload public copies of our artifacts (no local paths, no boot id) and the verified files themselves.
    staging = stage_upload(root, result.files, manifest)
    result.upload = upload_to_hub(staging, repo_id, result.files, private=private, revision=revision,
                                  endpoint=endpoint, progress=progress)
    manifest = load_manifest(root)
    manifest.stages[PUBLISH_STAGE] = StageRecord(
        settings={"repo_id": repo_id, "revision": revision, "private": private,
                  "force_unvalidated": readiness.forced_unvalidated},
        complete=True,
        finished_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        outputs={"commit_url": result.upload.commit_url, "repo_url": result.upload.repo_url,
                 "files": len(result.files), "bytes": result.total_bytes,
                 "card_sha256": hashlib.sha256(card.encode()).hexdigest()},
    )
    save_manifest(root, manifest)
    return result


def publish_result_json(result: PublishResult) -> str:
    return json.dumps(result.to_dict(), indent=2, default=str)
