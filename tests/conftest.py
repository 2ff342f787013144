"""Shared fixtures: tiny synthetic Kimi K2 INT4 checkpoints written on the fly, the CUDA skip marker, and the
comparison of two validate reports that the multi-process tests share (their ranks: tests/gloo_ranks.py)."""

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


# Relative tolerance between validate figures computed by different numbers of ranks (docs/distributed.md).
RANK_TOLERANCE = 1e-4
_VALIDATE_FIGURES = ("kl_mean", "kl_p99", "kl_max", "ppl_int4", "ppl_nvfp4", "ppl_ratio")


def _close(x: float, y: float) -> bool:
    return x == y or abs(x - y) <= RANK_TOLERANCE * max(abs(x), abs(y))


def _assert_validate_figures_agree(a: dict, b: dict) -> None:
    """Two validate reports (JSON) of the same checkpoint and data, computed by different numbers of ranks (or
    resumed): same verdict, same positions, top-1 within one near-tie, KL / perplexity and per-layer drift within
    RANK_TOLERANCE, the same weight-check summary."""
    assert a["passed"] == b["passed"]
    for ea, eb in zip(a["end_to_end"], b["end_to_end"], strict=True):
        assert ea["positions"] == eb["positions"]
        assert abs(ea["top1"] - eb["top1"]) <= 1 / ea["positions"]  # at most one near-tie may flip
        for key in _VALIDATE_FIGURES:
            assert _close(ea[key], eb[key]), (ea["mode"], key, ea[key], eb[key])
    for la, lb in zip(a["layers"], b["layers"], strict=True):
        assert la["layer"] == lb["layer"] and la["drift"].keys() == lb["drift"].keys()
        for mode in la["drift"]:
            assert _close(la["drift"][mode], lb["drift"][mode]), (la["layer"], mode)
    assert a["weights"] == b["weights"]  # every expert compared once, summarized in expert order


@pytest.fixture(scope="session")
def validate_figures_agree() -> Callable[[dict, dict], None]:
    return _assert_validate_figures_agree
