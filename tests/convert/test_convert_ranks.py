"""Convert under torch.distributed (gloo, two CPU processes): the same folder as one process, and a job one of
whose ranks fails resumes without converting a finished shard again (convert/ranks.py)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from kimi_nvfp4.checkpoint.manifest import MANIFEST_NAME, load_manifest
from kimi_nvfp4.convert import api as convert_api
from kimi_nvfp4.convert.api import convert_checkpoint
from kimi_nvfp4.convert.ranks import RankFailure, assign_jobs, journal_name, raise_first_failure
from kimi_nvfp4.distributed import RankContext
from kimi_nvfp4.synth import create_synthetic_checkpoint

from ..gloo_ranks import gloo_rank, spawn_ranks

SHARDS = 4
WORLD = 2
INJECTED = "injected failure on rank 1"


def _worker(rank: int, world: int, port: int, source: str, out: str, fail_after: int, result_dir: str) -> None:
    if fail_after >= 0 and rank == 1:
        real, done = convert_api.run_shard_job, []

        def failing(job, *args, **kwargs):
            if len(done) >= fail_after:
                raise RuntimeError(INJECTED)
            done.append(job.file)
            return real(job, *args, **kwargs)

        convert_api.run_shard_job = failing
    outcome: dict = {}
    with gloo_rank(rank, world, port):
        try:
            summary = convert_checkpoint(source, out, device="cpu", progress=False)
            outcome = {"ranks": summary.ranks, "converted": summary.shards_converted}
        except Exception as e:  # noqa: BLE001 - recorded for the test to check
            outcome = {"error": type(e).__name__, "message": str(e), "exit_code": getattr(e, "exit_code", None)}
    Path(result_dir, f"rank{rank}.json").write_text(json.dumps(outcome))


def _spawn(source: Path, out: Path, results: Path, fail_after: int = -1) -> list[dict]:
    results.mkdir(parents=True, exist_ok=True)
    spawn_ranks(_worker, WORLD, str(source), str(out), fail_after, str(results))
    return [json.loads((results / f"rank{r}.json").read_text()) for r in range(WORLD)]


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file() and not p.name.startswith(".")
            and p.name != MANIFEST_NAME}


def _records(folder: Path) -> tuple[dict, dict]:
    m = load_manifest(folder)
    return {f: r.model_dump() for f, r in m.shards.items()}, m.tensor_stats


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("ranks") / "int4"
    create_synthetic_checkpoint(path, preset="tiny", shards=SHARDS, seed=3)
    return path


@pytest.fixture(scope="module")
def one_process(source, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("one") / "nvfp4"
    convert_checkpoint(source, out, device="cpu", progress=False)
    return out


def test_two_ranks_write_the_same_folder_as_one_process(source, one_process, tmp_path):
    out = tmp_path / "nvfp4"
    outcomes = _spawn(source, out, tmp_path / "results")
    assert all(o.get("ranks") == WORLD for o in outcomes), outcomes
    assert all(o["converted"] == outcomes[0]["converted"] for o in outcomes)  # every rank reports the whole run
    assert _files(out) == _files(one_process)  # shards, index, configs: byte for byte
    assert _records(out) == _records(one_process)
    assert load_manifest(out).complete
    assert not [p for p in out.iterdir() if p.name.endswith(".journal.json")]  # folded into the manifest


def test_a_failed_rank_fails_the_job_and_its_finished_shards_are_not_converted_again(source, one_process, tmp_path):
    out = tmp_path / "nvfp4"
    outcomes = _spawn(source, out, tmp_path / "results", fail_after=1)
    assert outcomes[1]["error"] == "RuntimeError" and INJECTED in outcomes[1]["message"]
    assert outcomes[0]["error"] == "RankFailure" and "rank 1 of 2 failed" in outcomes[0]["message"]
    assert outcomes[0]["exit_code"] == 70  # the failing rank's error was a bug: the job exits as it would
    journal = json.loads((out / journal_name(1)).read_text())
    assert len(journal["shards"]) == 1  # rank 1 finished one shard before failing
    assert not load_manifest(out).complete

    resumed = convert_checkpoint(source, out, device="cpu", progress=False)
    plan_jobs = resumed.shards_total
    finished_before = plan_jobs - resumed.shards_converted
    assert finished_before >= 2  # rank 0's shards and rank 1's journaled shard were kept
    assert set(journal["shards"]) <= set(load_manifest(out).shards)
    assert _files(out) == _files(one_process)
    assert _records(out) == _records(one_process)


def _job(file: str, size: int) -> SimpleNamespace:
    return SimpleNamespace(file=file, input_bytes=size)  # what assign_jobs reads of a ShardJob


def test_shards_are_dealt_largest_first_to_the_least_loaded_rank():
    jobs = [_job(f"s{i}", size) for i, size in enumerate([5, 1, 4, 4, 2, 9])]
    split = assign_jobs(jobs, 2)
    assert sorted(j.file for part in split for j in part) == sorted(j.file for j in jobs)  # each exactly once
    assert [[j.file for j in part] for part in split] == [["s3", "s5"], ["s0", "s1", "s2", "s4"]]
    assert split == assign_jobs(list(jobs), 2)  # deterministic: every rank computes the same split
    assert [len(p) for p in assign_jobs(jobs[:1], 3)] == [1, 0, 0]


def test_the_lowest_failing_rank_is_raised_with_its_exit_code():
    ctx = RankContext(0, 3)
    raise_first_failure(ctx, [None, None, None], None)  # nobody failed: nothing raised
    with pytest.raises(RankFailure, match="rank 1 of 3 failed: CheckpointError: bad") as e:
        raise_first_failure(ctx, [None, (3, "CheckpointError: bad"), (70, "RuntimeError: x")], None)
    assert e.value.exit_code == 3
    own = ValueError("mine")
    with pytest.raises(ValueError, match="mine"):
        raise_first_failure(ctx, [(70, "ValueError: mine"), (3, "x")], own)
