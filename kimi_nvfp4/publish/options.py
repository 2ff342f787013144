"""`PublishOptions`: publish's options, read by `kimi-nvfp4 publish`, `[publish]` in pipeline.toml and
`publish_checkpoint` (see kimi_nvfp4/stage_options.py for how one field becomes all three)."""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import Field

from ..stage_options import StageOptions

DEFAULT_HASH_WORKERS = 4
MAX_HASH_WORKERS = 64


class PublishOptions(StageOptions):
    private: bool = Field(False, description="Create the repository as private.")
    revision: str | None = Field(None, description="Branch to upload to (created if missing); default main.")
    dry_run: bool = Field(False, description="List every file, its size and the model card; no network, no writes.")
    force_unvalidated: bool = Field(
        False, description="Publish although validate is missing or failed; the card says so. Shard checks still "
                           "apply.")
    base_model: str | None = Field(None, description="Hub id of the source model for the card (default: from the "
                                                     "manifest).")
    endpoint: str | None = Field(None, description="Hub URL (default: HF_ENDPOINT or https://huggingface.co).")
    workers: int = Field(DEFAULT_HASH_WORKERS, ge=1, le=MAX_HASH_WORKERS, description="Threads hashing shards in "
                                                                                      "parallel.")

    # What a real upload records (with the repo id): the same repo, branch and options is the same upload.
    RECORDED: ClassVar[tuple[str, ...]] = ("revision", "private", "force_unvalidated")

    def recorded(self) -> dict[str, Any]:
        return self.model_dump(mode="json", include=set(self.RECORDED))
