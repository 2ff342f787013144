"""Fixtures for the convert stage: small multi-shard sources and helpers that damage them."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kimi_nvfp4.checkpoint.reader import INDEX_NAME
from kimi_nvfp4.synth import make_tiny_k2

# A small vocabulary keeps the embedding from dominating shards (the tokenizer is not used here).
SMALL_VOCAB = 256


@pytest.fixture(scope="session")
def _source_master(tmp_path_factory) -> Path:
    return make_tiny_k2(tmp_path_factory.mktemp("convert_src") / "ckpt", vocab_size=SMALL_VOCAB, shards=5)


@pytest.fixture
def source(tmp_path, _source_master) -> Path:
    """A private copy of a 5-shard tiny K2.6 INT4 checkpoint (3 layers, 8 experts, vocab 256)."""
    dst = tmp_path / "src"
    shutil.copytree(_source_master, dst)
    return dst


def weight_map(root: Path) -> dict[str, str]:
    return json.loads((root / INDEX_NAME).read_text())["weight_map"]


def edit_tensor(root: Path, name: str, edit: Callable[[torch.Tensor], torch.Tensor]) -> Path:
    """Rewrite the shard holding `name` with `edit(tensor)` in its place. Returns the shard path."""
    shard = root / weight_map(root)[name]
    tensors = load_file(str(shard))
    tensors[name] = edit(tensors[name]).contiguous()
    save_file(tensors, str(shard), metadata={"format": "pt"})
    return shard


def edit_config(root: Path, edit: Callable[[dict], None]) -> None:
    path = root / "config.json"
    config = json.loads(path.read_text())
    edit(config)
    path.write_text(json.dumps(config))


def move_tensors(root: Path, names: list[str], new_file: str) -> None:
    """Move `names` out of their shards into a new shard `new_file` and update the index."""
    index_path = root / INDEX_NAME
    index = json.loads(index_path.read_text())
    moved: dict[str, torch.Tensor] = {}
    for shard in sorted({index["weight_map"][n] for n in names}):
        tensors = load_file(str(root / shard))
        for n in names:
            if n in tensors:
                moved[n] = tensors.pop(n)
        save_file(tensors, str(root / shard), metadata={"format": "pt"})
    save_file(moved, str(root / new_file), metadata={"format": "pt"})
    for n in names:
        index["weight_map"][n] = new_file
    index_path.write_text(json.dumps(index))
