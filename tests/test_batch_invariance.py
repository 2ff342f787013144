"""Calibrate's and validate's results do not depend on how the work is cut (kimi_nvfp4/model/batch_invariant.py).

The demo model is calibrated with the work cut several ways -- one process, 2 and 3 gloo ranks (each rank with one
thread, as torchrun sets it), MLP/MoE chunks that split sequences unevenly -- and every input scale and FP8 KV scale
must be bit-identical to one process at the default chunk size. Validate's per-position figures are then identical
too: at another chunk size in one process the report's end-to-end figures and drifts are equal to the last bit
(per-expert errors, sums whose terms are grouped by chunk, to 1e-12).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kimi_nvfp4.calibrate import INPUT_SCALES_SHARD
from kimi_nvfp4.calibrate.api import calibrate_checkpoint
from kimi_nvfp4.convert.api import convert_checkpoint
from kimi_nvfp4.demo_model import DEMO_CHECKPOINT
from kimi_nvfp4.validate.api import validate_checkpoint

from .gloo_ranks import gloo_rank, spawn_ranks

SAMPLES, SEQ_LEN = 6, 64
# (world size, MLP/MoE chunk tokens): None is the default; 37, 50 and 23 cut sequences of 64 at uneven places
CUTS = [(1, 37), (2, 50), (3, 23)]


def _calibrate(out: Path, chunk: int | None) -> None:
    calibrate_checkpoint(out, DEMO_CHECKPOINT, "sample", samples=SAMPLES, seq_len=SEQ_LEN, device="cpu",
                         progress=False, save_activation_stats=False, max_chunk_tokens=chunk)


def _worker(rank: int, world: int, port: int, out: str, chunk: int | None) -> None:
    with gloo_rank(rank, world, port):
        _calibrate(Path(out), chunk)


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    root = tmp_path_factory.mktemp("invariance")
    base = root / "nvfp4"
    convert_checkpoint(DEMO_CHECKPOINT, base, device="cpu", progress=False, record_stats=False)
    outs = {}
    for world, chunk in [(1, None), *CUTS]:
        out = root / f"w{world}_c{chunk}"
        shutil.copytree(base, out)
        if world == 1:
            _calibrate(out, chunk)
        else:
            spawn_ranks(_worker, world, str(out), chunk)
        outs[(world, chunk)] = out
    return outs


@pytest.mark.parametrize("world,chunk", CUTS, ids=[f"world{w}-chunk{c}" for w, c in CUTS])
def test_scales_are_bit_identical_however_the_work_is_cut(calibrated, world, chunk):
    ref = load_file(calibrated[(1, None)] / INPUT_SCALES_SHARD)
    got = load_file(calibrated[(world, chunk)] / INPUT_SCALES_SHARD)
    assert ref.keys() == got.keys()
    assert any(k.endswith("k_scale") for k in ref) and any(k.endswith("experts.0.down_proj.input_scale") for k in ref)
    differ = [k for k in ref if not torch.equal(ref[k], got[k])]
    assert not differ, f"{len(differ)} of {len(ref)} scales differ, e.g. {differ[:3]}"


def test_validate_figures_are_identical_at_another_chunk_size(calibrated, tmp_path):
    out = calibrated[(1, None)]
    reports = []
    for chunk in (None, 37):
        report = tmp_path / f"report_{chunk}"
        validate_checkpoint(out, DEMO_CHECKPOINT, "sample", report_dir=report, samples=5, seq_len=SEQ_LEN,
                            device="cpu", progress=False, record_in_manifest=False, max_chunk_tokens=chunk)
        reports.append(json.loads((report / "validate_report.json").read_text()))
    a, b = reports
    assert a["end_to_end"] and a["end_to_end"] == b["end_to_end"]
    assert a["baseline"] == b["baseline"]
    for la, lb in zip(a["layers"], b["layers"], strict=True):
        assert la["drift"] == lb["drift"] and la["worst_expert"] == lb["worst_expert"]
        # an expert's error is a sum over the chunks its tokens came in: the same terms, grouped per chunk
        for mode, value in la["expert_rel_mse_max"].items():
            assert value == pytest.approx(lb["expert_rel_mse_max"][mode], rel=1e-12), (la["layer"], mode)
