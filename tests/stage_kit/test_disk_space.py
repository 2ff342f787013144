"""Disk is part of the plan (stage_kit/disk_space.py): convert refuses an output it cannot finish before writing a
shard, and the model stages warn when their resume snapshots would not fit."""

from __future__ import annotations

import logging
from collections import namedtuple

import pytest

from kimi_nvfp4.convert.api import convert_checkpoint
from kimi_nvfp4.errors import ResourceError
from kimi_nvfp4.stage_kit import disk_space
from kimi_nvfp4.stage_kit.disk_space import GIB, free_bytes, require_free_space, warn_if_snapshots_cannot_fit

_Usage = namedtuple("_Usage", "total used free")


def _disk_with(monkeypatch, free: int) -> None:
    monkeypatch.setattr(disk_space.shutil, "disk_usage", lambda path: _Usage(10 * free, 9 * free, free))


def test_free_space_of_a_folder_not_yet_made_is_its_ancestors(tmp_path):
    assert free_bytes(tmp_path / "a" / "b") == free_bytes(tmp_path)


def test_too_little_space_names_need_and_free(tmp_path, monkeypatch):
    _disk_with(monkeypatch, 2 * GIB)
    with pytest.raises(ResourceError, match=r"convert needs ~5\.0 GiB more on the disk of .*, which has 2\.0 GiB free"):
        require_free_space(tmp_path, 5 * GIB, "convert")
    assert require_free_space(tmp_path, 0, "convert") == 2 * GIB


def test_convert_refuses_before_writing_a_shard(tiny_int4_checkpoint, tmp_path, monkeypatch):
    _disk_with(monkeypatch, GIB // 2)  # less than the margin alone
    out = tmp_path / "out"
    with pytest.raises(ResourceError, match="convert needs"):
        convert_checkpoint(tiny_int4_checkpoint, out, device="cpu", progress=False)
    assert not list(out.glob("model-*.safetensors"))


def test_snapshots_that_cannot_fit_are_warned_about(tmp_path, monkeypatch, caplog):
    _disk_with(monkeypatch, 10 * GIB)
    with caplog.at_level(logging.WARNING):
        warn_if_snapshots_cannot_fit(14 * GIB, tmp_path, 10, "validate")
    assert "validate: a resume snapshot needs ~14.0 GiB" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        warn_if_snapshots_cannot_fit(14 * GIB, tmp_path, 0, "validate")  # snapshots off
        warn_if_snapshots_cannot_fit(1 * GIB, tmp_path, 10, "validate")  # they fit
    assert not caplog.text
