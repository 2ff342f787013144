"""Upload a folder to the Hugging Face Hub with huggingface_hub, resumably.

- huggingface_hub 0.25-1.x: `HfApi.upload_large_folder` (multi-commit, keeps its progress under
  `.cache/huggingface/upload/` in the folder, so re-running resumes).
- huggingface_hub >= 2: `upload_folder` is itself the resumable multi-commit pipeline when `hf_xet` is installed
  (hf_api.py `upload_folder`: "re-running the same call resumes it"); without `hf_xet` it makes one commit and the
  LFS batch API skips every blob the Hub already has, so a re-run re-sends only missing shards.

The token: we never read it into our own variables beyond checking that one exists; huggingface_hub resolves it
(HF_TOKEN, then its token store) and sends it only as an Authorization header. Error messages from the Hub are
scrubbed of it anyway before they reach the user.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..errors import KimiNvfp4Error, OutputError
from .files import PublishFile

REPO_TYPE = "model"
DEFAULT_COMMIT_MESSAGE = "Upload NVFP4 checkpoint (kimi-nvfp4)"
_REDACTED = "<redacted>"


class HubAuthError(KimiNvfp4Error):
    """No Hugging Face token is available (HF_TOKEN unset and no stored login)."""

    exit_code = 7  # 6 is serve-check's ServerLaunchError; codes stay distinct across `run`


@dataclass
class UploadResult:
    repo_url: str
    commit_url: str | None
    commit_oid: str | None
    revision: str | None
    method: str  # which huggingface_hub entry point ran

    def to_dict(self) -> dict:
        return asdict(self)


def _scrub(message: str) -> str:
    """Remove the token from text we did not write ourselves (HTTP error bodies)."""
    from huggingface_hub import get_token

    token = get_token()
    return message.replace(token, _REDACTED) if token else message


def upload_to_hub(
    folder: str | Path,
    repo_id: str,
    files: list[PublishFile],
    *,
    private: bool = False,
    revision: str | None = None,
    endpoint: str | None = None,
    commit_message: str = DEFAULT_COMMIT_MESSAGE,
    num_workers: int | None = None,
    progress: bool = True,
) -> UploadResult:
    """Create the repo (and branch) if needed, then upload exactly `files` from `folder`.

    `endpoint` defaults to HF_ENDPOINT / https://huggingface.co (huggingface_hub's own resolution).
    """
    from huggingface_hub import HfApi, get_token

    if get_token() is None:
        raise HubAuthError("no Hugging Face token: set HF_TOKEN or run `hf auth login` (the token is never printed)")
    api = HfApi(endpoint=endpoint)
    with _hub_progress_bars(progress):
        return _upload(api, folder, repo_id, files, private=private, revision=revision,
                       commit_message=commit_message, num_workers=num_workers)


@contextmanager
def _hub_progress_bars(enabled: bool) -> Iterator[None]:
    """huggingface_hub draws its own bars; `progress=False` silences them for this upload only."""
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    was_disabled = are_progress_bars_disabled()
    if not enabled:
        disable_progress_bars()
    try:
        yield
    finally:
        if not enabled and not was_disabled:
            enable_progress_bars()


def _upload(api: Any, folder: str | Path, repo_id: str, files: list[PublishFile], *, private: bool,
            revision: str | None, commit_message: str, num_workers: int | None) -> UploadResult:
    from huggingface_hub.utils import HfHubHTTPError  # (utils re-exports it in every version we support)

    # Exact file names as patterns: what is uploaded is what --dry-run listed (checks.py refuses glob characters).
    allow = [f.path for f in files]
    try:
        # private=None (not False) leaves a new repo to the namespace's default visibility.
        repo_url = str(api.create_repo(repo_id, repo_type=REPO_TYPE, private=private or None, exist_ok=True))
        if revision:
            api.create_branch(repo_id, branch=revision, repo_type=REPO_TYPE, exist_ok=True)
        if hasattr(api, "upload_large_folder"):
            kwargs = {"num_workers": num_workers} if num_workers else {}
            api.upload_large_folder(repo_id=repo_id, folder_path=str(folder), repo_type=REPO_TYPE,
                                    revision=revision, private=private or None, allow_patterns=allow, **kwargs)
            return UploadResult(repo_url, None, None, revision, "upload_large_folder")
        info = api.upload_folder(repo_id=repo_id, folder_path=str(folder), repo_type=REPO_TYPE, revision=revision,
                                 allow_patterns=allow, commit_message=commit_message)
        return UploadResult(repo_url, info.commit_url, info.oid, revision, "upload_folder")
    except (HfHubHTTPError, *_transport_errors()) as e:  # HTTP status, connection refused, DNS, disk
        first_line = (_scrub(str(e)).splitlines() or [type(e).__name__])[0]
        raise OutputError(f"Hub upload of {folder} to {repo_id} failed: {first_line}") from None


def _transport_errors() -> tuple[type[BaseException], ...]:
    """Connection-level errors of whichever HTTP client this huggingface_hub uses (httpx2, httpx or requests)."""
    errors: list[type[BaseException]] = [OSError]
    for module in ("httpx2", "httpx", "requests"):
        try:
            mod = __import__(module)
        except ImportError:
            continue
        base = getattr(mod, "HTTPError", None) or getattr(mod, "RequestException", None)
        if isinstance(base, type) and issubclass(base, BaseException):
            errors.append(base)
    return tuple(errors)


def resolved_endpoint(endpoint: str | None) -> str:
    """The Hub URL an upload would go to (for messages; never includes credentials)."""
    from huggingface_hub import constants

    return (endpoint or os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")
