"""publish lists only regular files: a link in the folder is never followed, listed or uploaded, and says so."""

from __future__ import annotations

import os
import shutil

import pytest

from kimi_nvfp4.errors import CheckpointError
from kimi_nvfp4.publish import check_publishable, list_publish_files, publish_checkpoint


@pytest.fixture
def outside(tmp_path):
    root = tmp_path / "outside"
    (root / "dir").mkdir(parents=True)
    (root / "secret").write_text("api-key=hunter2")
    (root / "dir" / "more.txt").write_text("also secret")
    return root


def test_links_and_special_files_are_not_listed_and_are_named_in_the_notes(publishable, outside):
    (publishable / "notes.txt").symlink_to(outside / "secret")
    (publishable / "zero.bin").symlink_to("/dev/zero")
    (publishable / "docs").symlink_to(outside / "dir")
    (publishable / "reports" / "extra.md").symlink_to(outside / "secret")
    os.mkfifo(publishable / "pipe")
    paths = {f.path for f in list_publish_files(publishable)}
    assert not paths & {"notes.txt", "zero.bin", "docs/more.txt", "reports/extra.md", "pipe"}
    result = publish_checkpoint(publishable, "me/x", dry_run=True, progress=False)
    assert {f.path for f in result.files}.isdisjoint({"notes.txt", "zero.bin", "docs/more.txt", "pipe"})
    notes = "\n".join(result.notes)
    for name in ("notes.txt", "zero.bin", "docs", "reports/extra.md"):
        assert f"not uploaded: {name} (a symbolic link" in notes, (name, notes)
    assert "not uploaded: pipe (not a regular file)" in notes
    assert "hunter2" not in result.render_dry_run()


def test_a_shard_replaced_by_a_link_is_refused(publishable, outside):
    shard = sorted(publishable.glob("model-*.safetensors"))[0]
    shutil.move(shard, outside / shard.name)
    shard.symlink_to(outside / shard.name)  # same bytes, same sha256: still not a file of this folder
    with pytest.raises(CheckpointError, match="is a symbolic link"):
        check_publishable(publishable, progress=False)
