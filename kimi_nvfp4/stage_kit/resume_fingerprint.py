"""What a resume snapshot must match (stage_kit/resume.py): the parts every stage's fingerprint shares.

A snapshot is only as good as the run it continues: the same checkpoint bytes, the same tokens on the same rank
of the same world size, the same compute (dtype, device kind, chunking) and the same code. Hashing 595 GB of
shards on every start is out of the question, so a checkpoint is identified by the sha256 of the files that
say what it is (config.json, hf_quant_config.json, the index) and by each shard's size and modification time:
any rewrite of a shard (convert, requantize, a copy) changes them, and a false mismatch only costs a restart.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .. import __version__
from ..checkpoint.reader import CheckpointReader
from ..checkpoint.verdict import load_file_digests, tokens_sha256
from ..distributed import RankContext


def checkpoint_identity(reader: CheckpointReader) -> dict[str, Any]:
    """The load files' sha256 and every shard's [size, mtime_ns] (see the module doc)."""
    shards = {}
    for name in reader.shard_files:
        st = (reader.root / name).stat()
        shards[name] = [st.st_size, st.st_mtime_ns]
    return {"path": str(reader.root.resolve()), "files": load_file_digests(reader.root), "shards": shards}


def compute_identity(device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    """What decides the bits of a token's activations besides the weights: dtype, device kind (and GPU model).
    Not the chunk size or the memory plan: the model's products are batch-invariant (model/batch_invariant.py), so
    a run resumed under another plan (another GPU's free memory) continues with the same bits."""
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    return {"dtype": str(dtype).removeprefix("torch."), "device": device.type, "gpu": gpu}


def run_identity(stage: str, ctx: RankContext, data: str, sequences: Sequence[torch.Tensor]) -> dict[str, Any]:
    """Stage, code version, this rank's place and the token ids it streams."""
    return {
        "stage": stage,
        "tool_version": __version__,
        "world_size": ctx.world_size,
        "rank": ctx.rank,
        "data": data,
        "sequences": len(sequences),
        "tokens_sha256": tokens_sha256(sequences),
    }
