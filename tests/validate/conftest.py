"""Fixtures for validate tests: a tiny INT4 source, converted and calibrated (both layouts)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from kimi_nvfp4.calibrate import calibrate_checkpoint
from kimi_nvfp4.convert.api import convert_checkpoint
from kimi_nvfp4.synth import create_synthetic_checkpoint


def _calibrated(root: Path, **synth) -> tuple[Path, Path]:
    src = create_synthetic_checkpoint(root / "src", preset="tiny", **synth)
    out = root / "out"
    convert_checkpoint(src, out, device="cpu", progress=False)
    calibrate_checkpoint(out, src, "sample", samples=4, seq_len=48, device="cpu", progress=False)
    return src, out


@pytest.fixture(scope="session")
def _calibrated_master(tmp_path_factory) -> tuple[Path, Path]:
    return _calibrated(tmp_path_factory.mktemp("calibrated"), shards=2)


@pytest.fixture
def calibrated_pair(tmp_path, _calibrated_master) -> tuple[Path, Path]:
    """(INT4 source, private copy of its calibrated NVFP4 conversion) in the K2.6 layout."""
    src, out = _calibrated_master
    dst = tmp_path / "calibrated"
    shutil.copytree(out, dst)
    return src, dst


@pytest.fixture(scope="session")
def calibrated_deepseek_pair(tmp_path_factory) -> tuple[Path, Path]:
    """The same in the plain DeepseekV3 (K2-Thinking) layout; read-only."""
    return _calibrated(tmp_path_factory.mktemp("calibrated_dsv3"), layout="deepseek_v3")
