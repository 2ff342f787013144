"""Shared fixtures: tiny synthetic Kimi K2 INT4 checkpoints written on the fly, and the CUDA skip marker."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kimi_nvfp4.synth import make_tiny_k2

_NO_CUDA = pytest.mark.skip(reason="needs a CUDA device")


def pytest_collection_modifyitems(config, items):
    """`@pytest.mark.gpu` tests are skipped where torch sees no CUDA device (never unconditionally)."""
    if torch.cuda.is_available():
        return
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(_NO_CUDA)


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def stage_device(request) -> str:
    """Where a model-stage test runs: the CPU reference, and CUDA on the GPU runs (gpu-marked, so skipped without
    CUDA by `pytest_collection_modifyitems`)."""
    return request.param


@pytest.fixture(name="make_tiny_k2")
def make_tiny_k2_fixture() -> Callable[..., Path]:
    """Factory fixture: `make_tiny_k2(tmp_path / "src", layers=4, shards=3, vocab_size=256)`."""
    return make_tiny_k2


@pytest.fixture(scope="session")
def _tiny_int4_checkpoint_master(tmp_path_factory) -> Path:
    return make_tiny_k2(tmp_path_factory.mktemp("tiny_k2") / "ckpt", shards=2)


@pytest.fixture
def tiny_int4_checkpoint(tmp_path, _tiny_int4_checkpoint_master) -> Path:
    """A private copy of the default tiny K2.6-layout INT4 checkpoint (3 layers, 8 experts, 2 shards)."""
    dst = tmp_path / "tiny_int4"
    shutil.copytree(_tiny_int4_checkpoint_master, dst)
    return dst


@pytest.fixture
def cuda_device() -> torch.device:
    """The CUDA device; skips the test when there is none."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    return torch.device("cuda")
