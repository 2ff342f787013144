"""`calibrate --method`'s staged layers are written on a writer thread while the next layer runs
(calibrate/fused_method.py `_write_layer`): `files` (what the resume snapshot and finalize record) never names a
layer whose file is not complete, and a failed write stops the run at the next read instead of being lost."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from kimi_nvfp4.calibrate import fused_method
from kimi_nvfp4.calibrate.fused_method import FusedMethodHook, _LayerSolve
from kimi_nvfp4.checkpoint.writer import ShardWriter


def _hook(tmp_path: Path) -> FusedMethodHook:
    """Only the staging half of the hook (its constructor needs a whole checkpoint; nothing else is used here)."""
    hook = FusedMethodHook.__new__(FusedMethodHook)
    hook.directory = tmp_path / "fused_experts"
    hook._files, hook._writer_thread, hook._in_flight = {}, None, None
    return hook


def _solved(value: float) -> _LayerSolve:
    solved = _LayerSolve()
    solved.tensors = {"model.layers.1.mlp.experts.0.down_proj.weight": torch.full((4, 8), value)}
    solved.items = 1
    return solved


def test_the_layer_loop_goes_on_while_the_staged_layer_is_written(tmp_path, monkeypatch):
    release = threading.Event()
    commit = ShardWriter.commit

    def slow_commit(self):
        assert release.wait(30)
        return commit(self)

    monkeypatch.setattr(fused_method.ShardWriter, "commit", slow_commit)
    hook = _hook(tmp_path)
    hook._write_layer(1, _solved(1.0))  # returns although the write is blocked
    assert hook._in_flight is not None and not hook._in_flight.done()
    release.set()
    files = hook.files  # waits for the write
    assert hook._in_flight is None and len(files) == 1
    (name,) = files
    with safe_open(hook.directory / name, "pt") as f:
        assert torch.equal(f.get_tensor("model.layers.1.mlp.experts.0.down_proj.weight"), torch.full((4, 8), 1.0))


def test_one_layer_is_in_flight_at_most_and_every_layer_is_recorded(tmp_path):
    hook = _hook(tmp_path)
    for layer in (1, 2, 3):
        hook._write_layer(layer, _solved(float(layer)))
    assert len(hook.files) == 3 and all((hook.directory / n).is_file() for n in hook.files)


def test_a_failed_write_is_raised_at_the_next_read(tmp_path, monkeypatch):
    def failing_commit(self):
        raise OSError("No space left on device")

    monkeypatch.setattr(fused_method.ShardWriter, "commit", failing_commit)
    hook = _hook(tmp_path)
    hook._write_layer(1, _solved(1.0))
    with pytest.raises(OSError, match="No space left"):
        hook.files
    assert hook.files == {}  # nothing recorded for the layer that failed
