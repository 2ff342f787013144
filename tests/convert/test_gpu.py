"""CUDA and CPU conversions write identical bytes (skipped without a CUDA device)."""

from __future__ import annotations

import pytest

from kimi_nvfp4.checkpoint.manifest import load_manifest
from kimi_nvfp4.convert import convert_checkpoint, job
from kimi_nvfp4.numerics.methods import weight_only_methods


@pytest.mark.gpu
@pytest.mark.parametrize("batch_bytes", [None, 3000], ids=["one-batch", "many-batches"])
@pytest.mark.parametrize("method", [m.value for m in weight_only_methods()])
def test_cuda_and_cpu_write_the_same_shards(source, tmp_path, monkeypatch, method, batch_bytes):
    if batch_bytes is not None:  # several batches in flight on the device
        monkeypatch.setitem(job._BATCH_INT4_BYTES, "cuda", batch_bytes)
    cpu, gpu = tmp_path / "cpu", tmp_path / "gpu"
    convert_checkpoint(source, cpu, method=method, device="cpu", progress=False)
    summary = convert_checkpoint(source, gpu, method=method, device="cuda", workers=2, progress=False)
    assert summary.device.startswith("cuda")
    a, b = load_manifest(cpu), load_manifest(gpu)
    assert {f: r.sha256 for f, r in a.shards.items()} == {f: r.sha256 for f, r in b.shards.items()}
    # Error statistics are float reductions (order differs on GPU); counts are exact.
    assert a.tensor_stats.keys() == b.tensor_stats.keys()
    for module, stats in a.tensor_stats.items():
        other = b.tensor_stats[module]
        assert stats["exact_fraction"] == other["exact_fraction"] and stats["numel"] == other["numel"]
        assert stats["rel_mse"] == pytest.approx(other["rel_mse"], rel=1e-6, abs=1e-12)
