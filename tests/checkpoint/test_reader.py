"""`CheckpointReader`'s shard handles (checkpoint/reader.py)."""

from __future__ import annotations

import torch


def test_a_reader_keeps_a_bounded_number_of_shards_mapped(make_tiny_k2, tmp_path):
    """Reading every tensor of a many-shard checkpoint leaves at most MAX_OPEN_SHARDS shards open (mapped pages
    count in the RSS until unmapped), and a shard closed that way is reopened on demand with the same bytes."""
    from kimi_nvfp4.checkpoint import reader as reader_module

    src = make_tiny_k2(tmp_path / "src", layers=4, shards=6)
    r = reader_module.CheckpointReader(src)
    first = {n: r.load(n) for n in r.weight_map}
    assert len(set(r.weight_map.values())) == 6
    original = reader_module.MAX_OPEN_SHARDS
    reader_module.MAX_OPEN_SHARDS = 2
    try:
        r.close()
        again = {n: r.load(n) for n in r.weight_map}
        assert len(r._handles) <= 2
    finally:
        reader_module.MAX_OPEN_SHARDS = original
    assert all(torch.equal(first[n], again[n]) for n in first)
