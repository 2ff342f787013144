"""Data-parallel calibrate and validate (gloo, two CPU processes) resume like single-process runs: rank 1 is killed
(os._exit: no cleanup, no exception) while loading a layer, the job stops, and the next two-rank run continues after the last layer every rank
snapshotted (stage_kit/resume.py) -- with the same scales as one process (bit for bit) and validate figures within
the rank tolerance of tests/test_distributed.py."""

from __future__ import annotations

import json
import os
import shutil
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file

from kimi_nvfp4.calibrate import INPUT_SCALES_SHARD
from kimi_nvfp4.calibrate.api import calibrate_checkpoint
from kimi_nvfp4.convert.api import convert_checkpoint
from kimi_nvfp4.demo_model import DEMO_CHECKPOINT
from kimi_nvfp4.stage_kit.resume import RECORD_NAME, RESUME_DIR
from kimi_nvfp4.validate.api import validate_checkpoint

from .gloo_ranks import gloo_rank, spawn_ranks

SAMPLES, SEQ_LEN = 6, 64
VALIDATE_SAMPLES = 5  # odd: the ranks get unequal shares
WORLD = 2
FAIL_AT = 2  # the demo model has 4 layers: rank 1 dies loading layer 2, after snapshots of layers 0 and 1
KILLED_EXIT = 9


# snapshots on every layer whatever the tiny model's layers cost next to a snapshot's fsync (the cap has its own tests)
NO_OVERHEAD_CAP = 1e6
def _calibrate(out: Path) -> None:
    calibrate_checkpoint(out, DEMO_CHECKPOINT, "sample", samples=SAMPLES, seq_len=SEQ_LEN, device="cpu",
                         progress=False, save_activation_stats=False, resume_every=1,
                         resume_max_overhead=NO_OVERHEAD_CAP)


def _validate(out: Path, report: Path) -> None:
    validate_checkpoint(out, DEMO_CHECKPOINT, "sample", report_dir=report, samples=VALIDATE_SAMPLES, seq_len=SEQ_LEN,
                        device="cpu", progress=False, record_in_manifest=False, resume_every=1,
                        resume_max_overhead=NO_OVERHEAD_CAP)


def _worker(rank: int, world: int, port: int, stage: str, fail: bool, out: str, report: str, results: str) -> None:
    from kimi_nvfp4.model import weights as model_weights

    loads: Counter = Counter()
    real = model_weights._CheckpointWeights.layer

    def counting(source, i, *args, **kwargs):
        loads[i] += 1
        if fail and rank == 1 and i == FAIL_AT:
            os._exit(KILLED_EXIT)  # as a kill -9 would: nothing of the process's cleanup runs
        return real(source, i, *args, **kwargs)

    model_weights._CheckpointWeights.layer = counting
    outcome: dict = {}
    with gloo_rank(rank, world, port):
        try:
            _calibrate(Path(out)) if stage == "calibrate" else _validate(Path(out), Path(report))
            outcome = {"ok": True}
        except Exception as e:  # noqa: BLE001 - recorded for the test to check
            outcome = {"error": type(e).__name__, "message": str(e)}
    outcome["loads"] = {str(k): v for k, v in sorted(loads.items())}
    Path(results, f"{stage}_{'fail' if fail else 'resume'}_rank{rank}.json").write_text(json.dumps(outcome))


def _spawn(stage: str, fail: bool, out: Path, report: Path, results: Path) -> list[dict | None]:
    """Each rank's outcome (None: the rank was killed)."""
    results.mkdir(parents=True, exist_ok=True)
    args = (stage, fail, str(out), str(report), str(results))
    if fail:
        with pytest.raises(mp.ProcessExitedException) as killed:
            spawn_ranks(_worker, WORLD, *args)
        assert killed.value.error_index == 1 and killed.value.exit_code == KILLED_EXIT
    else:
        spawn_ranks(_worker, WORLD, *args)
    name = f"{stage}_{'fail' if fail else 'resume'}"
    paths = [results / f"{name}_rank{r}.json" for r in range(WORLD)]
    return [json.loads(p.read_text()) if p.is_file() else None for p in paths]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One process straight through; two ranks killed then resumed, calibrate then validate."""
    root = tmp_path_factory.mktemp("dist_resume")
    base = root / "nvfp4"
    convert_checkpoint(DEMO_CHECKPOINT, base, device="cpu", progress=False, record_stats=False)
    one, two = root / "one", root / "two"
    shutil.copytree(base, one)
    shutil.copytree(base, two)
    _calibrate(one)
    _validate(one, root / "report_one")
    outcomes = {}
    for stage in ("calibrate", "validate"):
        if stage == "validate":  # two ranks straight through, for the exact comparison
            _spawn(stage, False, two, root / "report_straight", root / "results_straight")
        outcomes[f"{stage}_fail"] = _spawn(stage, True, two, root / "report_two", root / "results")
        where = two if stage == "calibrate" else root / "report_two"
        outcomes[f"{stage}_record"] = json.loads((where / RESUME_DIR / stage / RECORD_NAME).read_text())
        outcomes[f"{stage}_resume"] = _spawn(stage, False, two, root / "report_two", root / "results")
        outcomes[f"{stage}_left"] = (where / RESUME_DIR).exists()
    outcomes["straight"] = root / "report_straight"
    return (one, root / "report_one"), (two, root / "report_two"), outcomes


@pytest.mark.parametrize("stage", ["calibrate", "validate"])
def test_a_killed_rank_stops_the_job_and_the_next_run_resumes_after_the_snapshot(runs, stage):
    _, _, outcomes = runs
    failed = outcomes[f"{stage}_fail"]
    assert failed[1] is None  # killed
    # the launcher stops rank 0 (as torchrun does), or it loses its peer in its next collective first
    assert failed[0] is None or "error" in failed[0]
    assert outcomes[f"{stage}_record"] == {"format": 1, "stage": stage, "layer": FAIL_AT - 1, "world_size": WORLD}
    per_layer = 1 if stage == "calibrate" else 2  # validate reads each layer of both checkpoints
    for resumed in outcomes[f"{stage}_resume"]:
        assert resumed.get("ok"), resumed
        assert resumed["loads"] == {"2": per_layer, "3": per_layer}  # layers 0 and 1 came from the snapshots
    assert not outcomes[f"{stage}_left"]  # deleted once the stage succeeded


def test_resumed_scales_equal_one_process(runs):
    (one, _), (two, _), _ = runs
    a, b = load_file(one / INPUT_SCALES_SHARD), load_file(two / INPUT_SCALES_SHARD)
    assert a.keys() == b.keys() and len(a) > 0
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_resumed_validate_figures_match_one_process(runs, validate_figures_agree):
    (_, r1), (_, r2), _ = runs
    a = json.loads((r1 / "validate_report.json").read_text())
    b = json.loads((r2 / "validate_report.json").read_text())
    assert len(a["layers"]) == len(b["layers"]) == 4
    validate_figures_agree(a, b)  # the weight check's running summary went through the snapshot too
    assert a["structure"] == b["structure"]


def test_resumed_validate_report_equals_two_ranks_straight_through(runs):
    _, (_, resumed), outcomes = runs
    a = json.loads((outcomes["straight"] / "validate_report.json").read_text())
    b = json.loads((resumed / "validate_report.json").read_text())
    for report in (a, b):
        report.pop("seconds")
        report.pop("memory_plan")  # the free memory of its moment, like the wall time
        report.pop("layer_seconds"), report.pop("layer_memory")  # per-layer wall time and peaks, likewise
        report["verdict"].pop("sealed_at")
    assert a == b  # every figure, bit for bit
