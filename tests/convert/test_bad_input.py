"""Bad input: a one-line error naming the file and tensor, a non-zero exit code, no finished-looking output."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest
import torch

from kimi_nvfp4.checkpoint.manifest import MANIFEST_NAME, load_manifest
from kimi_nvfp4.checkpoint.reader import INDEX_NAME
from kimi_nvfp4.checkpoint.writer import is_partial_name
from kimi_nvfp4.cli import main

from .conftest import edit_config, edit_tensor, weight_map

EXPERT = "language_model.model.layers.2.mlp.experts.5.down_proj"
CHECKPOINT_ERROR = 3
OUTPUT_ERROR = 4


def run_cli(capsys, *args: str) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exc:
        main(["convert", *map(str, args), "--device", "cpu", "--no-progress"])
    err = capsys.readouterr().err.strip()
    return exc.value.code, err


def assert_nothing_finished(out: Path) -> None:
    """No config, index or quant config; any shard present is recorded in an incomplete manifest."""
    if not out.exists():
        return
    names = {p.name for p in out.iterdir()}
    assert not names & {"config.json", INDEX_NAME, "hf_quant_config.json", "tokenizer_config.json"}
    assert not [n for n in names if is_partial_name(n)]
    if MANIFEST_NAME in names:
        manifest = load_manifest(out)
        assert not manifest.complete
        assert {n for n in names if n.endswith(".safetensors")} == set(manifest.shards)


def expect_failure(capsys, src: Path, out: Path, code: int, *fragments: str) -> None:
    rc, err = run_cli(capsys, src, out)
    assert rc == code, err
    assert len(err.splitlines()) == 1, err
    for fragment in fragments:
        assert fragment in err, (fragment, err)
    assert_nothing_finished(out)


def test_missing_shard(source, tmp_path, capsys):
    shard = weight_map(source)[f"{EXPERT}.weight_packed"]
    (source / shard).unlink()
    expect_failure(capsys, source, tmp_path / "out", CHECKPOINT_ERROR, shard, "missing")


def test_truncated_shard(source, tmp_path, capsys):
    shard = source / weight_map(source)[f"{EXPERT}.weight_packed"]
    shard.write_bytes(shard.read_bytes()[:-100])
    expect_failure(capsys, source, tmp_path / "out", CHECKPOINT_ERROR, shard.name, "truncated")


def test_index_names_a_tensor_the_shard_lacks(source, tmp_path, capsys):
    index = json.loads((source / INDEX_NAME).read_text())
    shard = index["weight_map"][f"{EXPERT}.weight_packed"]
    index["weight_map"]["language_model.model.layers.2.ghost.weight"] = shard
    (source / INDEX_NAME).write_text(json.dumps(index))
    expect_failure(capsys, source, tmp_path / "out", CHECKPOINT_ERROR, shard, "language_model.model.layers.2.ghost.weight")


def test_expert_missing_from_the_index(source, tmp_path, capsys):
    index = json.loads((source / INDEX_NAME).read_text())
    del index["weight_map"][f"{EXPERT}.weight_scale"]
    (source / INDEX_NAME).write_text(json.dumps(index))
    # The tensor is still in its shard: named as unindexed (it would otherwise vanish from the output).
    expect_failure(capsys, source, tmp_path / "out", CHECKPOINT_ERROR, f"{EXPERT}.weight_scale",
                   "the index does not name it")


def test_wrong_dtype(source, tmp_path, capsys):
    shard = edit_tensor(source, f"{EXPERT}.weight_scale", lambda t: t.float())
    expect_failure(capsys, source, tmp_path / "out", CHECKPOINT_ERROR, shard.name, f"{EXPERT}.weight_scale", "torch.bfloat16")


def test_wrong_shape(source, tmp_path, capsys):
    shard = edit_tensor(source, f"{EXPERT}.weight_packed", lambda t: t[:, :2])
    expect_failure(capsys, source, tmp_path / "out", CHECKPOINT_ERROR, shard.name, f"{EXPERT}.weight_packed", "[64, 4]")


def test_weight_shape_disagrees_with_packed_size(source, tmp_path, capsys):
    shard = edit_tensor(source, f"{EXPERT}.weight_shape", lambda t: torch.tensor([64, 64], dtype=torch.int32))
    expect_failure(capsys, source, tmp_path / "out", CHECKPOINT_ERROR, shard.name, f"{EXPERT}.weight_shape", "[64, 64]")


@pytest.mark.parametrize(
    "bad, words",
    [(float("nan"), "NaN/Inf"), (float("inf"), "NaN/Inf"), (0.0, "zero or negative"), (-0.01, "zero or negative")],
    ids=["nan", "inf", "zero", "negative"],
)
def test_bad_group_scales_fail_during_conversion(source, tmp_path, capsys, bad, words):
    def poison(t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        t[3, 0] = bad
        return t

    shard = edit_tensor(source, f"{EXPERT}.weight_scale", poison)
    expect_failure(capsys, source, tmp_path / "out", CHECKPOINT_ERROR, shard.name, f"{EXPERT}.weight_scale", words)


def _weights(c: dict) -> dict:
    return c["config_groups"]["group_0"]["weights"]


@pytest.mark.parametrize(
    "edit, words",
    [
        (lambda c: c.update(quant_method="fp8"), "quant_method 'fp8'"),
        (lambda c: c.update(format="nvfp4-pack-quantized"), "format"),
        (lambda c: _weights(c).update(num_bits=8), "num_bits"),
        (lambda c: _weights(c).update(group_size=128), "group_size"),
        (lambda c: _weights(c).update(symmetric=False), "symmetric"),
        (lambda c: _weights(c).update(actorder="group"), "actorder"),
        (lambda c: _weights(c).update(strategy="channel"), "strategy"),
        (lambda c: c["config_groups"]["group_0"].update(input_activations={"num_bits": 8, "type": "float"}), "activations"),
        (lambda c: c["config_groups"].update(group_1=c["config_groups"]["group_0"]), "config_groups"),
    ],
    ids=["method", "format", "bits", "group-size", "asymmetric", "actorder", "strategy", "activations", "two-groups"],
)
def test_unsupported_quantization_config(source, tmp_path, capsys, edit, words):
    def both(config: dict) -> None:
        edit(config["quantization_config"])
        config["text_config"]["quantization_config"] = config["quantization_config"]

    edit_config(source, both)
    expect_failure(capsys, source, tmp_path / "out", CHECKPOINT_ERROR, "config.json", words)


def test_quantization_config_levels_disagree(source, tmp_path, capsys):
    edit_config(source, lambda c: _weights(c["text_config"]["quantization_config"]).update(group_size=64))
    expect_failure(capsys, source, tmp_path / "out", CHECKPOINT_ERROR, "config.json", "differ")


def test_missing_quantization_config(source, tmp_path, capsys):
    def drop(c: dict) -> None:
        del c["quantization_config"]
        del c["text_config"]["quantization_config"]

    edit_config(source, drop)
    expect_failure(capsys, source, tmp_path / "out", CHECKPOINT_ERROR, "config.json", "missing")


def test_output_folder_holding_other_content(source, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    rc, err = run_cli(capsys, source, out)
    assert rc == OUTPUT_ERROR and "other content" in err and "notes.txt" in err and len(err.splitlines()) == 1
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    rc, err = run_cli(capsys, source, out, "--overwrite")  # never empties a folder that is not ours
    assert rc == OUTPUT_ERROR and (out / "notes.txt").read_text() == "mine"


def test_disk_full_leaves_no_finished_file(source, tmp_path, capsys, monkeypatch):
    import kimi_nvfp4.checkpoint.writer as writer_module

    target = weight_map(source)[f"{EXPERT}.weight_packed"]
    real_open = Path.open

    def full_disk_open(self, mode="r", *args, **kwargs):
        f = real_open(self, mode, *args, **kwargs)
        if "w" in mode and self.name == f".{target}.partial":
            def write(_data):
                raise OSError(errno.ENOSPC, "No space left on device")

            f.write = write
        return f

    monkeypatch.setattr(writer_module.Path, "open", full_disk_open)
    out = tmp_path / "out"
    expect_failure(capsys, source, out, OUTPUT_ERROR, target, "disk full")
    assert not (out / target).exists()
