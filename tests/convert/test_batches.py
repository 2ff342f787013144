"""The converter's batched, pipelined group loop (the CUDA flow), exercised on CPU."""

from __future__ import annotations

import functools

import pytest

from kimi_nvfp4.checkpoint.manifest import load_manifest
from kimi_nvfp4.convert import convert_checkpoint, job
from kimi_nvfp4.convert.plan import plan_conversion
from kimi_nvfp4.errors import CheckpointError
from kimi_nvfp4.numerics.methods import SearchPath, quantize_int4_groups

from .conftest import edit_tensor, weight_map


def _cuda_flow_on_cpu(monkeypatch, batch_bytes: int, ring: bool = False) -> None:
    """Batches of `batch_bytes`, two in flight, and the no-read-back numerics, all on the CPU (with `ring`, inputs
    read into the job's reused input buffers, as on CUDA)."""
    monkeypatch.setitem(job._PINNED_INPUT_RING, "cpu", ring)
    monkeypatch.setitem(job._BATCH_INT4_BYTES, "cpu", batch_bytes)
    monkeypatch.setitem(job._BATCHES_IN_FLIGHT, "cpu", 2)
    monkeypatch.setattr(job, "quantize_int4_groups", functools.partial(quantize_int4_groups, path=SearchPath.REFERENCE))


def test_batches_cover_every_group_in_order_within_budget(source, monkeypatch):
    import torch

    groups = [g for j in plan_conversion(source).jobs for g in j.groups]
    size = max(sum(m.int4_bytes for m in g.matrices) for g in groups)
    cut = list(job.batches(groups, torch.device("cuda")))
    assert [g for b in cut for g in b] == groups and len(cut) == 1  # a tiny model fits one CUDA batch
    assert len(list(job.batches(groups, torch.device("cpu")))) == len(groups)  # CPU: one group per batch
    monkeypatch.setitem(job._BATCH_INT4_BYTES, "cpu", 2 * size)
    cut = list(job.batches(groups, torch.device("cpu")))
    assert [g for b in cut for g in b] == groups and 1 < len(cut) < len(groups)
    assert all(sum(m.int4_bytes for g in b for m in g.matrices) <= 2 * size for b in cut)
    capped = list(job.batches(groups, torch.device("cuda"), cap=2 * size))  # the shard-relative cap applies too
    assert [g for b in capped for g in b] == groups and len(capped) == len(cut)


@pytest.mark.parametrize("ring", [False, True], ids=["own-tensors", "input-ring"])
@pytest.mark.parametrize("method", ["amax", "int4-aware"])
def test_pipelined_batches_write_the_same_bytes(source, tmp_path, monkeypatch, method, ring):
    reference = tmp_path / "ref"
    convert_checkpoint(source, reference, method=method, device="cpu", progress=False)
    _cuda_flow_on_cpu(monkeypatch, batch_bytes=3000, ring=ring)
    taken = []
    real_take = job._InputRing.take
    monkeypatch.setattr(job._InputRing, "take", lambda self, n: taken.append((id(self), n)) or real_take(self, n))
    out = tmp_path / "out"
    convert_checkpoint(source, out, method=method, device="cpu", progress=False)
    a, b = load_manifest(reference), load_manifest(out)
    assert {f: r.sha256 for f, r in a.shards.items()} == {f: r.sha256 for f, r in b.shards.items()}
    assert a.tensor_stats == b.tensor_stats
    rings = {r for r, _ in taken}
    assert (len(taken) > 2 * len(rings)) if ring else not taken  # buffers are taken again and again


def test_input_ring_reuses_one_buffer_per_batch_in_flight():
    ring = job._InputRing(depth=2)
    first, second = ring.take(100), ring.take(50)
    assert ring.take(80).data_ptr() == first.data_ptr() and ring.take(50).data_ptr() == second.data_ptr()
    grown = ring.take(1000)  # a larger batch replaces that slot's buffer
    assert grown.numel() == 1000 and ring.take(10).data_ptr() == second.data_ptr()


def test_bad_scale_in_a_later_batch_is_named_and_nothing_is_finished(source, tmp_path, monkeypatch):
    name = next(n for n in weight_map(source) if n.endswith("experts.5.down_proj.weight_scale"))

    def poison(t):
        t = t.clone()
        t[0, 0] = float("nan")
        return t

    edit_tensor(source, name, poison)
    _cuda_flow_on_cpu(monkeypatch, batch_bytes=3000)
    out = tmp_path / "out"
    with pytest.raises(CheckpointError, match="NaN/Inf") as err:
        convert_checkpoint(source, out, device="cpu", progress=False)
    assert name in str(err.value)
    shard = weight_map(source)[name]
    assert not (out / shard).exists()
