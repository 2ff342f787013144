"""Deliberate corruptions of a converted checkpoint, to prove that validate fails on them.

Each one is a mistake a converter or a hand edit really makes; `CORRUPTIONS` maps its name to the
function and to the gate that must catch it. Used by the tests and by `bench/speed/validate.py
--self-test` (run validate on each corrupted copy and check it exits 1 for the right reason).
These edit the checkpoint IN PLACE: only ever run them on a copy.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from ..checkpoint.reader import CONFIG_NAME, CheckpointReader
from ..checkpoint.writer import ShardWriter, write_bytes_atomic, write_index


def rewrite_tensor(checkpoint: Path, name: str, change: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Replace one tensor in its shard by `change(tensor)` (the rest of the shard is kept byte for byte)."""
    reader = CheckpointReader(checkpoint)
    file = reader.weight_map[name]
    writer = ShardWriter(checkpoint / file)
    for n in reader.shard_tensors(file):
        t = reader.load(n)
        writer.add(n, change(t) if n == name else t)
    reader.close()
    writer.commit()


def _expert(checkpoint: Path, proj: str, expert: int) -> str:
    layout = CheckpointReader(checkpoint).layout
    return layout.expert_module(layout.text.moe_layers[0], expert, proj)


def swap_gate_up_block_scales(checkpoint: Path, expert: int = 1) -> str:
    """gate_proj and up_proj of one expert get each other's E4M3 block scales."""
    gate, up = _expert(checkpoint, "gate_proj", expert), _expert(checkpoint, "up_proj", expert)
    reader = CheckpointReader(checkpoint)
    g, u = reader.load(f"{gate}.weight_scale"), reader.load(f"{up}.weight_scale")
    rewrite_tensor(checkpoint, f"{gate}.weight_scale", lambda _: u)
    rewrite_tensor(checkpoint, f"{up}.weight_scale", lambda _: g)
    return gate


def zero_block_scales(checkpoint: Path, expert: int = 2) -> str:
    """All block scales of one expert's down_proj set to 0."""
    down = _expert(checkpoint, "down_proj", expert)
    rewrite_tensor(checkpoint, f"{down}.weight_scale", torch.zeros_like)
    return down


def flip_nibble_order(checkpoint: Path, expert: int = 3) -> str:
    """Even/odd columns swapped in one weight (odd column in the low nibble: the classic packing bug)."""
    up = _expert(checkpoint, "up_proj", expert)
    rewrite_tensor(checkpoint, f"{up}.weight", lambda t: ((t & 0x0F) << 4) | (t >> 4))
    return up


def drop_input_scale(checkpoint: Path, expert: int = 0) -> str:
    """One input_scale removed from the index (as if calibration skipped a linear)."""
    name = f"{_expert(checkpoint, 'gate_proj', expert)}.input_scale"
    reader = CheckpointReader(checkpoint)
    weight_map = {n: f for n, f in reader.weight_map.items() if n != name}
    write_index(checkpoint, weight_map, sum(reader.info(n).nbytes for n in weight_map))
    return name


def restore_int4_config(checkpoint: Path, source: Path) -> str:
    """The source's compressed-tensors block put back into text_config (NVIDIA's first K2.6 upload did this)."""
    cfg = json.loads((checkpoint / CONFIG_NAME).read_text())
    src = json.loads((source / CONFIG_NAME).read_text())
    src_text = src.get("text_config", src)
    where = "text_config" if isinstance(cfg.get("text_config"), dict) else "top level"
    target = cfg["text_config"] if where == "text_config" else cfg
    target["quantization_config"] = src_text["quantization_config"]
    write_bytes_atomic(checkpoint / CONFIG_NAME, (json.dumps(cfg, indent=2) + "\n").encode())
    return where


@dataclass(frozen=True)
class Corruption:
    apply: Callable[..., str]  # returns the tensor/module/place it broke
    must_fail: tuple[str, ...]  # gates that must fail, each naming what apply() returned
    needs_source: bool = False


CORRUPTIONS: dict[str, Corruption] = {
    "swap-gate-up-scales": Corruption(swap_gate_up_block_scales, ("weights.rel_mse_max",)),
    "zero-block-scales": Corruption(zero_block_scales, ("structure.block_scales", "weights.rel_mse_max")),
    "flip-nibble-order": Corruption(flip_nibble_order, ("weights.rel_mse_max",)),
    "drop-input-scale": Corruption(drop_input_scale, ("structure.input_scale", "w4a4.ran")),
    "stale-int4-config": Corruption(restore_int4_config, ("structure.config.no_stale_compressed_tensors",), True),
}
