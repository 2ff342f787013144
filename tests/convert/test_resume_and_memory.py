"""Resuming, refusing other settings, and the memory bound of the streaming conversion."""

from __future__ import annotations

import json

import pytest

from kimi_nvfp4.checkpoint.manifest import (
    MANIFEST_NAME,
    StageRecord,
    load_manifest,
    save_manifest,
)
from kimi_nvfp4.checkpoint.output_lock import LOCK_NAME
from kimi_nvfp4.checkpoint.reader import INDEX_NAME
from kimi_nvfp4.convert import api, convert_checkpoint
from kimi_nvfp4.errors import CheckpointError, OutputError
from kimi_nvfp4.synth import make_tiny_k2

from .conftest import SMALL_VOCAB, edit_tensor


def _shas(out):
    return {f: r.sha256 for f, r in load_manifest(out).shards.items()}


def test_rerun_after_completion_skips_every_shard_and_touches_nothing(source, tmp_path):
    out = tmp_path / "out"
    first = convert_checkpoint(source, out, device="cpu", progress=False)
    # What a later stage does: add a file and an index entry, record itself in the manifest.
    index = json.loads((out / INDEX_NAME).read_text())
    index["weight_map"]["language_model.model.layers.1.mlp.experts.0.gate_proj.input_scale"] = "model-input-scales.safetensors"
    (out / INDEX_NAME).write_text(json.dumps(index))
    manifest = load_manifest(out)
    manifest.stages["calibrate"] = StageRecord(complete=True)
    save_manifest(out, manifest)
    def contents():  # the lock file holds the latest holder's pid and start time: not checkpoint content
        return {p.name: p.read_bytes() for p in out.iterdir() if p.name != LOCK_NAME}

    before = contents()
    again = convert_checkpoint(source, out, device="cpu", progress=False)
    assert (first.shards_converted, again.shards_converted, again.shards_skipped) == (5, 0, 5)
    assert contents() == before
    assert load_manifest(out).complete and load_manifest(out).stages["calibrate"].complete


def test_interrupted_run_resumes_where_it_stopped(source, tmp_path, monkeypatch):
    out = tmp_path / "out"
    reference = tmp_path / "reference"
    convert_checkpoint(source, reference, device="cpu", progress=False)
    files = sorted(_shas(reference))
    real_job = api.run_shard_job

    def crash_on_third(job, *args, **kwargs):
        if job.file == files[2]:
            raise KeyboardInterrupt("simulated crash")
        return real_job(job, *args, **kwargs)

    monkeypatch.setattr(api, "run_shard_job", crash_on_third)
    with pytest.raises(KeyboardInterrupt):
        convert_checkpoint(source, out, device="cpu", progress=False)
    manifest = load_manifest(out)
    assert not manifest.complete and sorted(manifest.shards) == files[:2]
    assert not (out / "config.json").exists() and not (out / INDEX_NAME).exists()
    (out / f".{files[2]}.partial").write_bytes(b"half a shard")  # what a crash mid-write leaves

    monkeypatch.setattr(api, "run_shard_job", real_job)
    summary = convert_checkpoint(source, out, device="cpu", progress=False)
    assert (summary.shards_converted, summary.shards_skipped) == (3, 2)
    assert _shas(out) == _shas(reference)
    assert not (out / f".{files[2]}.partial").exists()
    assert (out / "config.json").read_bytes() == (reference / "config.json").read_bytes()


def test_a_shard_missing_from_the_output_is_redone(source, tmp_path):
    out = tmp_path / "out"
    convert_checkpoint(source, out, device="cpu", progress=False)
    before = _shas(out)
    victim = sorted(before)[1]
    (out / victim).unlink()
    summary = convert_checkpoint(source, out, device="cpu", progress=False)
    assert summary.shards_converted == 1 and _shas(out) == before


def test_other_settings_are_refused_unless_overwrite(source, tmp_path):
    out = tmp_path / "out"
    convert_checkpoint(source, out, method="amax", device="cpu", progress=False)
    with pytest.raises(OutputError, match="other settings"):
        convert_checkpoint(source, out, method="int4-aware", device="cpu", progress=False)
    with pytest.raises(OutputError, match="other settings"):
        convert_checkpoint(source, out, method="amax", kv_cache_quant_algo=None, device="cpu", progress=False)
    summary = convert_checkpoint(source, out, method="int4-aware", device="cpu", overwrite=True, progress=False)
    assert summary.shards_converted == 5 and load_manifest(out).settings.method == "int4-aware"


def test_another_source_is_refused(source, tmp_path):
    out = tmp_path / "out"
    convert_checkpoint(source, out, device="cpu", progress=False)
    edit_tensor(source, "language_model.model.layers.1.self_attn.o_proj.weight", lambda t: t[:32])
    with pytest.raises(OutputError, match="another source"):
        convert_checkpoint(source, out, device="cpu", progress=False)


def test_same_layout_with_other_weights_is_another_source(tmp_path):
    a = make_tiny_k2(tmp_path / "a", vocab_size=SMALL_VOCAB, layers=2, experts=4)
    b = make_tiny_k2(tmp_path / "b", vocab_size=SMALL_VOCAB, layers=2, experts=4, seed=1)
    out = tmp_path / "out"
    convert_checkpoint(a, out, device="cpu", progress=False)
    with pytest.raises(OutputError, match="another source"):
        convert_checkpoint(b, out, device="cpu", progress=False)


def test_malformed_manifest_is_not_trusted(source, tmp_path):
    out = tmp_path / "out"
    convert_checkpoint(source, out, device="cpu", progress=False)
    (out / MANIFEST_NAME).write_text("{not json")
    with pytest.raises(OutputError, match="manifest"):
        convert_checkpoint(source, out, device="cpu", overwrite=True, progress=False)
    with pytest.raises(CheckpointError, match="malformed"):
        load_manifest(out)


def test_manifest_round_trips(source, tmp_path):
    out = tmp_path / "out"
    convert_checkpoint(source, out, device="cpu", progress=False)
    manifest = load_manifest(out)
    save_manifest(out, manifest)
    assert load_manifest(out) == manifest
    data = json.loads((out / MANIFEST_NAME).read_text())
    data["unexpected"] = 1
    (out / MANIFEST_NAME).write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match="malformed"):
        load_manifest(out)


def test_a_job_holds_one_tensor_or_one_scale_group_not_a_shard(tmp_path):
    # Twelve MoE layers in eight shards: the checkpoint is ~8x a shard; output streams tensor by tensor.
    src = make_tiny_k2(tmp_path / "src", vocab_size=SMALL_VOCAB, layers=13, experts=16, shards=8)
    summary = convert_checkpoint(src, tmp_path / "out", device="cpu", progress=False)
    assert summary.shards_converted == 8
    assert summary.bytes_in > 7 * summary.max_shard_bytes
    assert 0 < summary.peak_tensor_bytes < summary.max_shard_bytes / 2


_RSS_CHILD = r"""
import json, resource, sys
from kimi_nvfp4.convert import convert_checkpoint
from kimi_nvfp4.convert.plan import plan_conversion
plan_conversion(sys.argv[1])  # warm imports and allocator before the baseline
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
summary = convert_checkpoint(sys.argv[1], sys.argv[2], device="cpu", method="amax", progress=False)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"growth": after - before, "max_shard": summary.max_shard_bytes, "total": summary.bytes_in}))
"""


@pytest.mark.slow
def test_peak_rss_growth_is_about_two_shards(tmp_path):
    """Process-level check: resident memory grows by <= ~2 shards while converting a 12-shard checkpoint."""
    import subprocess
    import sys

    # Eleven dense layers of ~12 MB BF16 MLP weights each, one MoE layer: many medium shards.
    src = make_tiny_k2(
        tmp_path / "src", vocab_size=SMALL_VOCAB, layers=12, first_k_dense_replace=11, hidden_size=512,
        intermediate_size=4096, code_distribution="uniform", shards=12,
    )
    proc = subprocess.run(
        [sys.executable, "-c", _RSS_CHILD, str(src), str(tmp_path / "out")], capture_output=True, text=True, check=True
    )
    m = json.loads(proc.stdout.strip().splitlines()[-1])
    assert m["total"] > 8 * m["max_shard"]
    slack = 16 * 2**20  # allocator and interpreter noise
    assert m["growth"] <= 2 * m["max_shard"] + slack, m


def test_without_stats_the_bytes_are_the_same(source, tmp_path):
    with_stats, without = tmp_path / "with", tmp_path / "without"
    convert_checkpoint(source, with_stats, device="cpu", progress=False)
    convert_checkpoint(source, without, device="cpu", progress=False, record_stats=False)
    assert _shas(with_stats) == _shas(without)
    assert len(load_manifest(with_stats).tensor_stats) == 48 and load_manifest(without).tensor_stats == {}
