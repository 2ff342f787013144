"""Rewrite one output shard: its routed-expert NVFP4 tensors re-chosen by an output-aware method, every other
tensor copied unchanged.

The method starts from the INT4 source (never from the shard's current NVFP4 values), so rewriting a shard is
idempotent: the same source, statistics and method give the same bytes however often it runs, which is what
makes a killed run resumable to identical bytes. Memory: the shard's tensors plus `batch_experts` experts'
INT4 matrices and statistics (a K2.6 gate/up Hessian is 205 MB in float32, 410 MB once widened to float64).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from ..calibrate.expert_stats import DOWN, GATE_UP
from ..calibrate.expert_stats_file import LayerStatsFile
from ..checkpoint.layout import parse_expert_name
from ..checkpoint.reader import CheckpointReader
from ..checkpoint.writer import ShardWriter, WrittenShard
from ..errors import CheckpointError
from ..numerics.constants import INT4_PER_INT32
from ..numerics.methods import ExpertMatrices, Int4Matrix, requantize_experts

# The projections that read each statistics input, in the order their tensors share a scale (gate+up: one
# weight_scale_2, as convert and SGLang's fused w13 require).
INPUT_PROJS = {GATE_UP: ("gate_proj", "up_proj"), DOWN: ("down_proj",)}
_GROUP_OF = {p: g for g, projs in INPUT_PROJS.items() for p in projs}
_NVFP4_SUFFIXES = ("weight", "weight_scale", "weight_scale_2")


@dataclass(frozen=True, order=True)
class ExpertInput:
    """One routed expert's matrices that read one input (gate+up, or down) in one layer."""

    layer: int
    expert: int
    group: str


@dataclass
class ShardOutcome:
    written: WrittenShard
    experts: int = 0
    sources: dict[str, int] = field(default_factory=dict)
    matrices_kept_search: int = 0


def expert_inputs_in(reader: CheckpointReader, file: str) -> list[ExpertInput]:
    """The expert inputs with at least one NVFP4 weight in `file` (sorted)."""
    found = set()
    for name in reader.shard_tensors(file):
        parsed = parse_expert_name(name)
        if parsed is not None and parsed.suffix == "weight" and parsed.proj in _GROUP_OF:
            found.add(ExpertInput(parsed.layer, parsed.expert, _GROUP_OF[parsed.proj]))
    return sorted(found)


def _int4(source: CheckpointReader, module: str, device: torch.device) -> Int4Matrix:
    packed, scale = f"{module}.weight_packed", f"{module}.weight_scale"
    if packed not in source or scale not in source:
        raise CheckpointError("the INT4 source has no such expert matrix", file=source.root, tensor=packed)
    weight_packed = source.load(packed)
    in_features = weight_packed.shape[-1] * INT4_PER_INT32
    return Int4Matrix.from_packed(weight_packed.to(device), source.load(scale).to(device), in_features)


def expert_matrices(
    source: CheckpointReader, item: ExpertInput, device: torch.device, stats: Any
) -> ExpertMatrices:
    layout = source.layout
    modules = [layout.expert_module(item.layer, item.expert, p) for p in INPUT_PROJS[item.group]]
    shared = stats.shared(item.group) if item.group == GATE_UP else None
    return ExpertMatrices(
        name=f"layers.{item.layer}.experts.{item.expert}.{item.group}",
        matrices=[_int4(source, m, device) for m in modules],
        stats=stats.expert(item.expert, item.group),
        shared_stats=shared,
    )


def rewrite_shard(
    output: Path,
    file: str,
    out_reader: CheckpointReader,
    source: CheckpointReader,
    stats_for_layer: Callable[[int], LayerStatsFile],
    *,
    method: str,
    device: torch.device,
    batch_experts: int,
    method_options: dict[str, Any] | None = None,
) -> ShardOutcome:
    """Rewrite `output/file` atomically (temporary name, fsync, rename); returns what was written and counted.

    :param stats_for_layer: the statistics file of a layer (checked by the caller against the manifest).
    :param method_options: the method's options (its typed model's fields; default its defaults).
    """
    items = expert_inputs_in(out_reader, file)
    outcome_sources: dict[str, int] = {}
    kept = 0
    replacements: dict[str, torch.Tensor] = {}
    for start in range(0, len(items), batch_experts):
        batch = items[start : start + batch_experts]
        experts = [expert_matrices(source, item, device, stats_for_layer(item.layer)) for item in batch]
        summary = requantize_experts(method, experts, batch_experts=batch_experts, options=method_options)
        for item, refined in zip(batch, summary.experts, strict=True):
            outcome_sources[refined.source.value] = outcome_sources.get(refined.source.value, 0) + 1
            kept += sum(refined.kept_search)
            replacements.update(expert_tensors(out_reader, item, refined.tensors))
    written = replace_in_shard(output / file, replacements)
    return ShardOutcome(written, len(items), dict(sorted(outcome_sources.items())), kept)


def expert_tensors(out_reader: CheckpointReader, item: ExpertInput, tensors: list[Any]) -> dict[str, torch.Tensor]:
    """The full tensor names and values of one expert input's NVFP4 result (`weight`, `weight_scale`,
    `weight_scale_2` per projection), on the CPU."""
    out = {}
    for proj, q in zip(INPUT_PROJS[item.group], tensors, strict=True):
        module = out_reader.layout.expert_module(item.layer, item.expert, proj)
        for suffix, value in zip(_NVFP4_SUFFIXES, (q.weight, q.weight_scale, q.weight_scale_2)):
            out[f"{module}.{suffix}"] = value.detach().to("cpu").contiguous()
    return out


def replace_in_shard(path: Path, replacements: dict[str, torch.Tensor]) -> WrittenShard:
    """Rewrite the shard at `path` atomically with the tensors of `replacements` it holds replaced (names it does not
    hold belong to another shard and are ignored), every other tensor and the metadata copied: requantize's
    rewrite and calibrate's fused method write the same bytes for the same values."""
    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata() or {}
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    for name, value in replacements.items():
        _replace(tensors, path, name, value)
    writer = ShardWriter(path, metadata={k: v for k, v in metadata.items() if k != "format"})
    for name, t in tensors.items():
        writer.add(name, t)
    return writer.commit()


def _replace(tensors: dict[str, torch.Tensor], path: Path, name: str, value: torch.Tensor) -> None:
    """Put `value` where the shard holds `name` (a partner's tensor in another shard is that shard's to write);
    dtype and shape must be what the shard already declares (the index and engines read those)."""
    old = tensors.get(name)
    if old is None:
        return
    value = value.detach().to("cpu").contiguous()
    if old.dtype != value.dtype or tuple(old.shape) != tuple(value.shape):
        raise CheckpointError(f"requantized tensor is {value.dtype} {tuple(value.shape)}, the shard holds "
                              f"{old.dtype} {tuple(old.shape)}", file=path, tensor=name)
    tensors[name] = value.reshape(old.shape)
