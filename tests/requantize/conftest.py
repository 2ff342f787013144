"""Fixtures for requantize tests: a tiny INT4 source (4 shards: two with routed experts, two without) converted to
NVFP4 and calibrated with dense expert statistics, copied per test."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from kimi_nvfp4.calibrate import calibrate_checkpoint
from kimi_nvfp4.convert.api import convert_checkpoint
from kimi_nvfp4.synth import create_synthetic_checkpoint

TINY_SAMPLES = 4
TINY_SEQ_LEN = 48
SHARDS = 4


def calibrate_tiny(src: Path, out: Path, **kw) -> None:
    kw = {"samples": TINY_SAMPLES, "seq_len": TINY_SEQ_LEN, "device": "cpu", "progress": False, **kw}
    calibrate_checkpoint(out, src, "sample", **kw)


@pytest.fixture(scope="session")
def _calibrated_master(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("requantize")
    src = create_synthetic_checkpoint(root / "src", preset="tiny", shards=SHARDS)
    out = root / "out"
    convert_checkpoint(src, out, device="cpu", progress=False)
    calibrate_tiny(src, out, expert_stats="hessian")
    return src, out


@pytest.fixture
def calibrated_pair(tmp_path, _calibrated_master) -> tuple[Path, Path]:
    """(INT4 source, private copy of its NVFP4 conversion, calibrated with --expert-stats hessian)."""
    src, out = _calibrated_master
    dst = tmp_path / "out"
    shutil.copytree(out, dst)
    return src, dst


def copy_of(pair: tuple[Path, Path], dst: Path) -> Path:
    shutil.copytree(pair[1], dst)
    return dst
