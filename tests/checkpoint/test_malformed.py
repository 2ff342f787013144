"""Malformed sources: refused with one line naming the file (and tensor), exit 3, before any output exists —
never a traceback, never a tensor silently dropped or read from another tensor's bytes.

Each case edits a private copy of a small tiny-K2 source (3 shards, vocab 256) the way a broken or hostile upload
would, then runs `kimi-nvfp4 convert`.
"""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from kimi_nvfp4.checkpoint.manifest import MANIFEST_NAME, load_manifest
from kimi_nvfp4.checkpoint.reader import INDEX_NAME
from kimi_nvfp4.cli import main
from kimi_nvfp4.synth import make_tiny_k2

CHECKPOINT_ERROR = 3
EXPERT = "language_model.model.layers.2.mlp.experts.5"
ATTENTION = "language_model.model.layers.1.self_attn.o_proj.weight"  # BF16, passed through
ROUTER_BIAS = "language_model.model.layers.2.mlp.gate.e_score_correction_bias"
_LEN = struct.Struct("<Q")


@pytest.fixture(scope="module")
def _master(tmp_path_factory) -> Path:
    return make_tiny_k2(tmp_path_factory.mktemp("malformed") / "ckpt", vocab_size=256, shards=3)


@pytest.fixture
def src(tmp_path, _master) -> Path:
    dst = tmp_path / "src"
    shutil.copytree(_master, dst)
    return dst


def _index(root: Path) -> dict:
    return json.loads((root / INDEX_NAME).read_text())


def _shard_of(root: Path, tensor: str) -> Path:
    return root / _index(root)["weight_map"][tensor]


def _rewrite_header(shard: Path, edit: Callable[[dict], Any]) -> None:
    """Replace a shard's JSON header by `edit(header)` (any JSON), keeping its data bytes."""
    raw = shard.read_bytes()
    (n,) = _LEN.unpack(raw[:8])
    header, data = json.loads(raw[8 : 8 + n]), raw[8 + n :]
    new = json.dumps(edit(header)).encode()
    new += b" " * (-len(new) % 8)
    shard.write_bytes(_LEN.pack(len(new)) + new + data)


def _edit_tensor(root: Path, name: str, edit: Callable[[torch.Tensor], torch.Tensor]) -> None:
    shard = _shard_of(root, name)
    tensors = load_file(str(shard))
    tensors[name] = edit(tensors[name]).contiguous()
    save_file(tensors, str(shard), metadata={"format": "pt"})


def _convert(capsys, src: Path, out: Path) -> tuple[int, str]:
    with pytest.raises(SystemExit) as e:
        main(["convert", str(src), str(out), "--method", "amax", "--no-stats", "--device", "cpu", "--no-progress"])
    return e.value.code, capsys.readouterr().err.strip()


def refused_before_output(capsys, src: Path, tmp_path: Path, *fragments: str) -> str:
    out = tmp_path / "out"
    code, err = _convert(capsys, src, out)
    assert code == CHECKPOINT_ERROR, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    for fragment in fragments:
        assert fragment in err, (fragment, err)
    assert not out.exists(), "the plan must stop before the output folder is made"
    return err


# --- shard headers ---------------------------------------------------------------------------------------------


def test_overlapping_data_offsets(src, tmp_path, capsys):
    """safetensors refuses these; convert once read up_proj from gate_proj's bytes."""
    gate, up = f"{EXPERT}.gate_proj.weight_packed", f"{EXPERT}.up_proj.weight_packed"
    shard = _shard_of(src, gate)
    assert _shard_of(src, up) == shard

    def overlap(header):
        header[up]["data_offsets"] = header[gate]["data_offsets"]
        return header

    _rewrite_header(shard, overlap)
    refused_before_output(capsys, src, tmp_path, shard.name, "data_offsets overlap those of", gate, up)


def test_a_tensor_in_a_shard_but_not_in_the_index(src, tmp_path, capsys):
    shard = _shard_of(src, ATTENTION)
    tensors = load_file(str(shard))
    tensors["language_model.model.layers.1.extra.weight"] = torch.ones(4, dtype=torch.bfloat16)
    save_file(tensors, str(shard), metadata={"format": "pt"})
    refused_before_output(capsys, src, tmp_path, shard.name, "language_model.model.layers.1.extra.weight",
                          "the index does not name it")


def test_a_safetensors_file_the_index_does_not_name(src, tmp_path, capsys):
    save_file({"x": torch.ones(2)}, str(src / "model-extra.safetensors"))
    refused_before_output(capsys, src, tmp_path, "model-extra.safetensors", "does not name")


def test_header_that_is_a_json_list(src, tmp_path, capsys):
    shard = _shard_of(src, ATTENTION)
    _rewrite_header(shard, lambda h: [h])
    refused_before_output(capsys, src, tmp_path, shard.name, "is a JSON list")


def test_header_entry_without_data_offsets(src, tmp_path, capsys):
    shard = _shard_of(src, ATTENTION)

    def drop(header):
        del header[ATTENTION]["data_offsets"]
        return header

    _rewrite_header(shard, drop)
    refused_before_output(capsys, src, tmp_path, shard.name, ATTENTION, "data_offsets None")


def test_pass_through_span_that_does_not_fit_its_shape_is_refused_by_the_plan(src, tmp_path, capsys):
    """Span, dtype and shape of pass-through tensors are checked from the headers before any output exists."""
    shard = _shard_of(src, ATTENTION)

    def shrink(header):
        header[ATTENTION]["shape"] = [header[ATTENTION]["shape"][0] // 2, header[ATTENTION]["shape"][1]]
        return header

    _rewrite_header(shard, shrink)
    refused_before_output(capsys, src, tmp_path, shard.name, ATTENTION, "needs")


@pytest.mark.parametrize("shape", [[-4, 2], "64", [2.5]], ids=["negative", "string", "float"])
def test_header_shape_that_is_not_a_list_of_counts(src, tmp_path, capsys, shape):
    shard = _shard_of(src, ATTENTION)

    def bad(header):
        header[ATTENTION]["shape"] = shape
        return header

    _rewrite_header(shard, bad)
    refused_before_output(capsys, src, tmp_path, shard.name, ATTENTION, "is not a list of non-negative integers")


# --- index and config ------------------------------------------------------------------------------------------


def test_non_string_weight_map_value(src, tmp_path, capsys):
    index = _index(src)
    index["weight_map"][ATTENTION] = 3
    (src / INDEX_NAME).write_text(json.dumps(index))
    refused_before_output(capsys, src, tmp_path, INDEX_NAME, "index is malformed", ATTENTION)


@pytest.mark.parametrize("path", ["sub/model.safetensors", "../x.safetensors", "/etc/x.safetensors", ".hidden"],
                         ids=["subfolder", "parent", "absolute", "hidden"])
def test_index_paths_outside_the_folder_top(src, tmp_path, capsys, path):
    index = _index(src)
    index["weight_map"][ATTENTION] = path
    (src / INDEX_NAME).write_text(json.dumps(index))
    refused_before_output(capsys, src, tmp_path, INDEX_NAME, ATTENTION, repr(path), "plain file name")


def test_index_that_is_a_list(src, tmp_path, capsys):
    (src / INDEX_NAME).write_text(json.dumps([_index(src)]))
    refused_before_output(capsys, src, tmp_path, INDEX_NAME, "is a JSON list")


def test_config_that_is_a_list(src, tmp_path, capsys):
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps([config]))
    refused_before_output(capsys, src, tmp_path, "config.json", "is a JSON list, expected an object")


def test_config_that_is_not_utf8(src, tmp_path, capsys):
    (src / "config.json").write_bytes(b'{"architectures": ["\xff\xfe"]}')
    refused_before_output(capsys, src, tmp_path, "config.json", "not valid JSON")


@pytest.mark.parametrize("value, shown", [("7168", "'7168' (str)"), (True, "True (bool)"), (None, "None (NoneType)")])
def test_hidden_size_of_the_wrong_type(src, tmp_path, capsys, value, shown):
    config = json.loads((src / "config.json").read_text())
    config["text_config"]["hidden_size"] = value
    (src / "config.json").write_text(json.dumps(config))
    refused_before_output(capsys, src, tmp_path, "config.json", f"hidden_size is {shown}; expected int")


def test_architectures_that_is_not_a_list_of_names(src, tmp_path, capsys):
    config = json.loads((src / "config.json").read_text())
    config["architectures"] = 5
    (src / "config.json").write_text(json.dumps(config))
    refused_before_output(capsys, src, tmp_path, "config.json", "architectures is 5; expected a list")


def test_invalid_json_from_the_hub(src, tmp_path, capsys, monkeypatch):
    """A Hub download (or a mirror answering with an HTML page) whose config.json is not JSON."""
    import huggingface_hub

    (src / "config.json").write_text("<html>rate limited</html>")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda *a, **k: str(src))
    refused_before_output(capsys, "moonshotai/Kimi-K2.6", tmp_path, "config.json", "not valid JSON")

    def hub_answers_garbage(*args, **kwargs):
        return json.loads("<html>")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", hub_answers_garbage)
    refused_before_output(capsys, "moonshotai/Kimi-K2.6", tmp_path, "cannot download from the Hub",
                          "JSONDecodeError")


# --- values --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_non_finite_router_bias_is_refused_by_the_plan(src, tmp_path, capsys, bad):
    _edit_tensor(src, ROUTER_BIAS, lambda t: t.index_fill(0, torch.tensor([3]), bad))
    refused_before_output(capsys, src, tmp_path, ROUTER_BIAS, "NaN/Inf values in the router bias")


@pytest.mark.parametrize("bad", [float("nan"), float("-inf")], ids=["nan", "inf"])
def test_non_finite_bf16_pass_through_tensor(src, tmp_path, capsys, bad):
    _edit_tensor(src, ATTENTION, lambda t: t.index_fill(1, torch.tensor([7]), bad))
    out = tmp_path / "out"
    code, err = _convert(capsys, src, out)
    assert code == CHECKPOINT_ERROR and len(err.splitlines()) == 1, err
    assert ATTENTION in err and "NaN/Inf values" in err and "torch.bfloat16" in err
    shard = _shard_of(src, ATTENTION).name
    assert not (out / shard).exists() and not (out / f".{shard}.partial").exists()
    assert not load_manifest(out).complete and shard not in load_manifest(out).shards
    assert not (out / "config.json").exists() and (out / MANIFEST_NAME).exists()
