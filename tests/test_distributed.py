"""Data-parallel calibrate and validate (gloo, two CPU processes) against one process on the demo model.

The input scales must be bit-identical (maxima), the weight check identical (each expert compared on one
rank, summarized in expert order), and the validate figures equal within RANK_TOLERANCE: a rank's MoE
chunks hold other tokens than one process's, and the BLAS picks its blocking by the number of rows, so a
token's activations can differ in the last bits (measured: 2.5e-6 relative on one position's KL); sums
are also added in another order.
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
from kimi_nvfp4.distributed import RankContext, rank_context, torchrun_command
from kimi_nvfp4.validate.api import validate_checkpoint

from .gloo_ranks import gloo_rank, spawn_ranks

SAMPLES, SEQ_LEN = 6, 64
VALIDATE_SAMPLES = 5  # odd: the ranks get unequal shares


def _stages(out: Path, report: Path) -> None:
    calibrate_checkpoint(out, DEMO_CHECKPOINT, "sample", samples=SAMPLES, seq_len=SEQ_LEN, device="cpu",
                         progress=False, save_activation_stats=False)
    validate_checkpoint(out, DEMO_CHECKPOINT, "sample", report_dir=report, samples=VALIDATE_SAMPLES,
                        seq_len=SEQ_LEN, device="cpu", progress=False, record_in_manifest=False)


def _worker(rank: int, world: int, port: int, out: str, report: str) -> None:
    with gloo_rank(rank, world, port) as ctx:
        assert ctx == RankContext(rank, world, rank)
        _stages(Path(out), Path(report))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist")
    base = root / "nvfp4"
    convert_checkpoint(DEMO_CHECKPOINT, base, device="cpu", progress=False, record_stats=False)
    one, two = root / "one", root / "two"
    shutil.copytree(base, one)
    shutil.copytree(base, two)
    _stages(one, root / "report_one")
    spawn_ranks(_worker, 2, str(two), str(root / "report_two"))
    return (one, root / "report_one"), (two, root / "report_two")


def test_input_scales_do_not_depend_on_the_number_of_ranks(runs):
    (one, _), (two, _) = runs
    a, b = load_file(one / INPUT_SCALES_SHARD), load_file(two / INPUT_SCALES_SHARD)
    assert a.keys() == b.keys() and len(a) > 0
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_validate_figures_match_one_process(runs, validate_figures_agree):
    (_, r1), (_, r2) = runs
    a = json.loads((r1 / "validate_report.json").read_text())
    b = json.loads((r2 / "validate_report.json").read_text())
    validate_figures_agree(a, b)
    assert [g["name"] for g in a["gates"]] == [g["name"] for g in b["gates"]]
    for la, lb in zip(a["layers"], b["layers"]):
        assert la["worst_expert"] == lb["worst_expert"]
    assert sorted((e["layer"], e["expert"], e["mode"], e["tokens"]) for e in a["worst_experts"]) == sorted(
        (e["layer"], e["expert"], e["mode"], e["tokens"]) for e in b["worst_experts"]
    )


def test_single_process_context_is_a_no_op(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    ctx = rank_context("cpu")
    assert not ctx.distributed and ctx.is_main
    assert ctx.shard([1, 2, 3]) == [1, 2, 3]
    t = torch.tensor([1.0, 2.0])
    assert ctx.all_reduce_sum_(t) is t and ctx.all_gather_object(5) == [5]
    assert RankContext(1, 3).shard(list(range(7))) == [1, 4]
    assert RankContext(1, 2, 1).device(torch.device("cuda")) == torch.device("cuda", 1)


def test_gpus_option_builds_a_torchrun_line():
    cmd = torchrun_command(4, ["calibrate", "out", "--source", "src"])
    assert cmd[1:3] == ["-m", "torch.distributed.run"] and "--nproc-per-node=4" in cmd
    assert cmd[-4:] == ["calibrate", "out", "--source", "src"]
    with pytest.raises(ValueError):
        torchrun_command(0, [])
