"""ResumeStore (stage_kit/resume.py): snapshots round-trip bit for bit, only a recorded snapshot whose fingerprint
matches is used, and a kill at any point of a save leaves the previous recorded snapshot usable."""

from __future__ import annotations

import json

import pytest
import torch
from pydantic import BaseModel, ConfigDict

from kimi_nvfp4.distributed import RankContext
from kimi_nvfp4.stage_kit.resume import (
    RECORD_NAME,
    TENSORS_NAME,
    ResumeStore,
    fingerprint_differences,
)

FINGERPRINT = {"stage": "calibrate", "options": {"seed": 0, "samples": 4}, "tokens_sha256": "ab"}


class State(BaseModel):
    model_config = ConfigDict(ser_json_inf_nan="constants")

    seconds: list[float]
    note: str


def _streams():
    g = torch.Generator().manual_seed(0)
    return {
        "hidden": [torch.randn(5 + i, 8, generator=g).to(torch.bfloat16) for i in range(3)],
        "w4a4": [torch.randn(5 + i, 8, generator=g) for i in range(3)],
    }


def _store(tmp_path, fingerprint=FINGERPRINT, ctx=RankContext(), every=1) -> ResumeStore:
    return ResumeStore(tmp_path, "calibrate", ctx, fingerprint, every=every)


def test_a_snapshot_round_trips_bit_for_bit(tmp_path):
    streams = _streams()
    scales = {"a.input_scale": torch.tensor(0.125), "b.input_scale": torch.tensor(float("inf"))}
    state = State(seconds=[0.1, 1 / 3, float("nan")], note="x")
    assert _store(tmp_path).save(4, state, streams, {"input_scale": scales})
    snap = _store(tmp_path).load()
    assert snap is not None and snap.layer == 4
    for name, seqs in streams.items():
        loaded = snap.stream(name, "cpu")
        assert len(loaded) == len(seqs)
        for a, b in zip(seqs, loaded):
            assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    got = dict(snap.tensors("input_scale"))
    assert got.keys() == scales.keys() and all(torch.equal(got[k], scales[k]) for k in scales)
    parsed = snap.parse(State)
    assert parsed.seconds[:2] == [0.1, 1 / 3] and parsed.seconds[2] != parsed.seconds[2] and parsed.note == "x"


def test_only_the_latest_snapshot_is_kept_and_finish_removes_all(tmp_path):
    store = _store(tmp_path)
    for layer in (0, 1, 2):
        store.save(layer, State(seconds=[], note=str(layer)), _streams())
    assert [p.name for p in store.rank_dir.iterdir()] == ["layer_002"]
    assert json.loads((store.stage_dir / RECORD_NAME).read_text())["layer"] == 2
    store.finish()
    assert not store.stage_dir.parent.exists()


def test_a_kill_before_the_record_keeps_the_previous_snapshot(tmp_path):
    store = _store(tmp_path)
    store.save(1, State(seconds=[], note="one"), _streams())
    # killed after writing its own snapshot of layer 2, before every rank had and rank 0 recorded it
    store._write(store.rank_dir / "layer_002", 2, State(seconds=[], note="two"), _streams(), {})
    (store.rank_dir / ".layer_003.partial").mkdir()  # and one killed mid-write
    snap = _store(tmp_path).load()
    assert snap.layer == 1 and snap.parse(State).note == "one"
    assert [p.name for p in store.rank_dir.iterdir()] == ["layer_001"]


@pytest.mark.parametrize("damage", ["fingerprint", "world_size", "truncated", "record"])
def test_a_snapshot_that_does_not_match_is_ignored_and_removed(tmp_path, damage, caplog):
    store = _store(tmp_path)
    store.save(1, State(seconds=[], note="one"), _streams())
    fingerprint, ctx = FINGERPRINT, RankContext()
    if damage == "fingerprint":
        fingerprint = {**FINGERPRINT, "options": {"seed": 1, "samples": 4}}
    elif damage == "world_size":
        record = store.stage_dir / RECORD_NAME
        record.write_text(json.dumps({**json.loads(record.read_text()), "world_size": 2}))
    elif damage == "truncated":
        path = store.rank_dir / "layer_001" / TENSORS_NAME
        path.write_bytes(path.read_bytes()[:-4])
    else:
        (store.stage_dir / RECORD_NAME).write_text("{not json")
    assert _store(tmp_path, fingerprint, ctx).load() is None
    assert not store.stage_dir.exists()
    expected = {"fingerprint": "options.seed: 0 -> 1", "world_size": "written by 2 ranks", "truncated": "bytes",
                "record": "unreadable"}[damage]
    assert expected in caplog.text


def test_nothing_there_is_not_an_error(tmp_path, caplog):
    assert _store(tmp_path).load() is None
    assert caplog.text == ""


def test_due_counts_layers_of_the_whole_run():
    store = ResumeStore("/nonexistent", "validate", RankContext(), {}, every=10)
    assert [d for d in range(1, 62) if store.due(d, 61)] == [10, 20, 30, 40, 50, 60]
    assert not ResumeStore("/nonexistent", "validate", RankContext(), {}, every=0).due(10, 61)
    assert not ResumeStore("/nonexistent", "validate", RankContext(), {}, every=1).due(61, 61)  # the last: no
    with pytest.raises(ValueError):
        ResumeStore("/nonexistent", "validate", RankContext(), {}, every=-1)


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_snapshots_are_skipped_while_they_would_exceed_the_overhead_cap(tmp_path, monkeypatch):
    """The first due snapshot is written (it measures the write time); later ones only while the snapshots' seconds
    plus one more stay within max_overhead of the run's time so far."""
    from kimi_nvfp4.stage_kit import resume as resume_module

    clock = FakeClock()
    monkeypatch.setattr(resume_module.time, "perf_counter", clock)
    store = ResumeStore(tmp_path, "validate", RankContext(), FINGERPRINT, every=1, max_overhead=0.1)
    real_write = store._write

    def slow_write(*args, **kwargs):  # every snapshot takes 9 s
        real_write(*args, **kwargs)
        clock.now += 9.0

    store._write = slow_write
    state, streams = State(seconds=[], note=""), _streams()
    written, shares = [], []
    for layer in range(60):
        clock.now += 10.0  # a layer's compute
        if store.due(layer + 1, 61):
            assert store.save(layer, state, streams)
            written.append(layer)
            shares.append(store._snapshot_seconds / clock.now)
    # Layer 0: nothing measured yet, written (9 s of 19). The next needs 9 + 9 <= 0.1 x elapsed, elapsed = 10 (L + 1)
    # + 9: L = 17; then 27 <= 0.1 x (10 (L + 1) + 18): L = 25.
    assert written[:3] == [0, 17, 25]
    assert store.skipped[:3] == [2, 3, 4] and len(written) + len(store.skipped) == 60
    assert all(share <= 0.1 for share in shares[1:])  # once measured, the snapshots stay within the cap
    with pytest.raises(ValueError, match="share"):
        ResumeStore(tmp_path, "validate", RankContext(), FINGERPRINT, every=1, max_overhead=0)


def test_fingerprint_differences_name_nested_keys():
    assert fingerprint_differences({"a": {"b": 1, "c": 2}}, {"a": {"b": 1, "c": 3}, "d": 4}) == [
        "a.c: 2 -> 3", "d: None -> 4"]


def test_a_record_that_cannot_be_written_keeps_the_previous_snapshot(tmp_path, monkeypatch, caplog):
    import kimi_nvfp4.stage_kit.resume as resume_module
    from kimi_nvfp4.errors import OutputError

    store = _store(tmp_path)
    store.save(1, State(seconds=[], note="one"), _streams())

    real = resume_module.write_json_atomic

    def full_disk_for_the_record(path, *args, **kwargs):
        if path.name == RECORD_NAME:
            raise OutputError("complete.json: disk full while writing")
        return real(path, *args, **kwargs)

    monkeypatch.setattr(resume_module, "write_json_atomic", full_disk_for_the_record)
    assert not store.save(2, State(seconds=[], note="two"), _streams())
    assert store.every == 0 and "cannot record the resume snapshot after layer 2" in caplog.text
    monkeypatch.undo()
    snap = _store(tmp_path).load()
    assert snap.layer == 1 and snap.parse(State).note == "one"
