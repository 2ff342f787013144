"""The per-layer expert statistics file: `OUTPUT/calibration/expert_stats/layer_LLL.safetensors`.

One file per MoE layer, written atomically when the layer's calibration pass is done (`ShardWriter`: temporary
name, fsync, rename), read by `kimi-nvfp4 requantize`. Tensors, per routed expert E and input G (`gate_up`,
`down`) it saw tokens at, and `shared.gate_up` for the layer's every-token statistics of the gate/up input:

    experts.E.G.tokens          int64 0-d   routed rows seen
    experts.E.G.channel_energy  float64 [in]   mean of x_j^2
    experts.E.G.hessian         float32 [in, in]   X^T X / n  (hessian mode, where tokens >= the dense threshold)
    experts.E.G.fourth_moments  float64 [2]   mean ||x||^4, mean sum_j x_j^4 (with the hessian)

and in `w4a4` mode, of the same rows and their NVFP4-quantized twins x~ (expert_stats.py):

    experts.E.G.quantized_energy  float64 [in]   mean of x~_j^2
    experts.E.G.cross_energy      float64 [in]   mean of x_j x~_j
    experts.E.G.quantized_hessian float32 [in, in]   X~^T X~ / n   (with the hessian)
    experts.E.G.cross             float32 [in, in]   X^T X~ / n    (with the hessian; row i: channel i of x)

The dense threshold is the one requantize applies (`DENSE_MIN_TOKENS_PER_CHANNEL` x input width): a Hessian
from fewer rows would be dropped there anyway, so it is not written (float32 on disk: K2.6's gate/up Hessian is
205 MB per expert). The header metadata holds the layer, the mode and the fallback counts (`LayerStatsCounts`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict
from safetensors import safe_open

from ..checkpoint.writer import ShardWriter, WrittenShard
from ..errors import CheckpointError
from ..numerics.methods import ExpertInputStats
from ..numerics.methods.output_aware.input_stats import QuantizedInputStats
from ..numerics.methods.output_aware.refine import DENSE_MIN_TOKENS_PER_CHANNEL, DIAGONAL_MIN_TOKENS
from .expert_stats import DOWN, GATE_UP, ExpertStatsMode, ExpertStatsObserver

EXPERT_STATS_DIR = "expert_stats"  # under OUTPUT/calibration
HESSIAN_DISK_DTYPE = torch.float32
_COUNTS_KEY = "counts"


def layer_stats_name(layer: int) -> str:
    return f"layer_{layer:03d}.safetensors"


class LayerStatsCounts(BaseModel):
    """How many expert inputs of a layer got which statistics (the fallbacks, counted)."""

    model_config = ConfigDict(extra="forbid")

    layer: int
    mode: str
    dense: int = 0  # a Hessian was written
    diagonal_fallback: int = 0  # hessian mode, too few tokens for a dense Hessian: channel energies only
    below_diagonal_min: int = 0  # fewer than DIAGONAL_MIN_TOKENS rows: requantize uses the shared stats (or none)
    without_tokens: int = 0  # never routed to: nothing written
    shared_gate_up: bool = False


@dataclass
class LayerExpertStats:
    """A layer's statistics as requantize reads them."""

    layer: int
    experts: dict[tuple[int, str], ExpertInputStats] = field(default_factory=dict)
    shared: dict[str, ExpertInputStats] = field(default_factory=dict)


def _enough_for_dense(tokens: int, width: int) -> bool:
    return tokens >= DENSE_MIN_TOKENS_PER_CHANNEL * width


def _add(out: dict[str, torch.Tensor], key: str, stats: ExpertInputStats, dense_ok: bool,
         device: str | None = "cpu") -> bool:
    where = device or stats.channel_energy.device
    out[f"{key}.tokens"] = torch.tensor(stats.tokens, dtype=torch.int64)
    out[f"{key}.channel_energy"] = stats.channel_energy.detach().to(where, torch.float64).contiguous()
    quantized = stats.quantized
    if quantized is not None:
        out[f"{key}.quantized_energy"] = quantized.energy.detach().to(where, torch.float64).contiguous()
        out[f"{key}.cross_energy"] = quantized.cross_energy.detach().to(where, torch.float64).contiguous()
    if stats.hessian is None or not dense_ok:
        return False
    out[f"{key}.hessian"] = stats.hessian.detach().to(where, HESSIAN_DISK_DTYPE).contiguous()
    if quantized is not None:
        out[f"{key}.quantized_hessian"] = quantized.hessian.detach().to(where, HESSIAN_DISK_DTYPE).contiguous()
        out[f"{key}.cross"] = quantized.cross.detach().to(where, HESSIAN_DISK_DTYPE).contiguous()
    moments = [stats.mean_norm_fourth or 0.0, stats.mean_fourth_power or 0.0]
    out[f"{key}.fourth_moments"] = torch.tensor(moments, dtype=torch.float64)
    return True


def layer_stats_tensors(layer: int, observer: ExpertStatsObserver, device: str | None = "cpu", *,
                        consume: bool = False) -> tuple[dict[str, torch.Tensor], LayerStatsCounts]:
    """One layer's statistics as the file holds them (names, dtypes, the dense threshold applied) and the fallback
    counts: what `write_layer_stats` writes and what calibrate's fused method reads in memory (`InMemoryLayerStats`),
    so both paths solve from the same numbers. `device` None keeps them where the sums are (the values are the
    same: only the dtype casts decide them). `consume`: drop each expert's sums from `observer` once converted, so
    the layer's sums and their converted copies are never both held whole (stage_kit/expert_solve_plan.py)."""
    counts = LayerStatsCounts(layer=layer, mode=observer.mode.value)
    out: dict[str, torch.Tensor] = {}
    for key in sorted(observer.experts):
        acc = observer.experts.pop(key) if consume else observer.experts[key]
        expert, group = key
        if acc.tokens == 0:
            counts.without_tokens += 1
            continue
        stats = acc.stats()
        dense = _add(out, f"experts.{expert}.{group}", stats, _enough_for_dense(stats.tokens, stats.in_features),
                     device)
        counts.dense += dense
        counts.diagonal_fallback += observer.dense and not dense
        counts.below_diagonal_min += stats.tokens < DIAGONAL_MIN_TOKENS
    if observer.shared is not None and observer.shared.tokens:
        stats = observer.shared.stats()
        _add(out, f"shared.{GATE_UP}", stats, _enough_for_dense(stats.tokens, stats.in_features), device)
        counts.shared_gate_up = True
    return out, counts


def write_layer_stats(
    directory: Path, layer: int, observer: ExpertStatsObserver
) -> tuple[WrittenShard, LayerStatsCounts]:
    """Write one layer's file atomically; returns it and the fallback counts."""
    tensors, counts = layer_stats_tensors(layer, observer)
    writer = ShardWriter(directory / layer_stats_name(layer))
    for name, tensor in tensors.items():
        writer.add(name, tensor)
    writer.metadata.update({"layer": str(layer), "mode": observer.mode.value, _COUNTS_KEY: counts.model_dump_json()})
    directory.mkdir(parents=True, exist_ok=True)
    return writer.commit(), counts


def _stats_from(key: str, names: set[str], get) -> ExpertInputStats | None:
    """The statistics under `key` (`experts.E.G`, `shared.G`) from tensors `get(name)`; None where there are none."""
    if f"{key}.tokens" not in names:
        return None
    tokens = int(get(f"{key}.tokens"))
    energy = get(f"{key}.channel_energy")
    dense = f"{key}.hessian" in names
    quantized = None
    if f"{key}.quantized_energy" in names:
        matrices = [get(f"{key}.{n}") for n in ("quantized_hessian", "cross")] if dense else []
        quantized = QuantizedInputStats(get(f"{key}.quantized_energy"), get(f"{key}.cross_energy"), *matrices)
    if not dense:
        return ExpertInputStats(tokens, energy, quantized=quantized)
    norm_fourth, fourth_power = get(f"{key}.fourth_moments").tolist()
    return ExpertInputStats(tokens, energy, get(f"{key}.hessian"), norm_fourth, fourth_power, quantized)


class InMemoryLayerStats:
    """A layer's statistics held in memory (`layer_stats_tensors`), read as `LayerStatsFile` reads its file."""

    def __init__(self, layer: int, tensors: dict[str, torch.Tensor]):
        self.layer = layer
        self.tensors = tensors
        self.names = set(tensors)

    def expert(self, expert: int, group: str) -> ExpertInputStats | None:
        return _stats_from(f"experts.{expert}.{group}", self.names, self.tensors.__getitem__)

    def shared(self, group: str) -> ExpertInputStats | None:
        return _stats_from(f"shared.{group}", self.names, self.tensors.__getitem__)


class LayerStatsFile:
    """One layer file, read one expert at a time (a K2.6 layer's Hessians are ~85 GB: never all at once).

    :param path: the file; its header is read at once, a malformed one is a CheckpointError naming it.
    """

    def __init__(self, path: Path):
        self.path = Path(path)
        try:
            with safe_open(str(self.path), framework="pt") as f:
                meta = f.metadata() or {}
                self.layer = int(meta["layer"])
                self.names = set(f.keys())
        except (OSError, KeyError, ValueError, RuntimeError) as e:
            raise CheckpointError(f"expert statistics file is unreadable or malformed ({e})", file=self.path) from None

    def keys(self) -> list[str]:
        """`experts.E.G` and `shared.G` keys present."""
        return sorted(n.removesuffix(".tokens") for n in self.names if n.endswith(".tokens"))

    def expert(self, expert: int, group: str) -> ExpertInputStats | None:
        return self._read(f"experts.{expert}.{group}")

    def shared(self, group: str) -> ExpertInputStats | None:
        return self._read(f"shared.{group}")

    def _read(self, key: str) -> ExpertInputStats | None:
        if f"{key}.tokens" not in self.names:
            return None
        try:
            with safe_open(str(self.path), framework="pt") as f:
                return _stats_from(key, self.names, f.get_tensor)
        except (OSError, KeyError, ValueError, RuntimeError) as e:
            raise CheckpointError(f"expert statistics are malformed ({e})", file=self.path, tensor=key) from None


def read_layer_stats(path: Path) -> LayerExpertStats:
    """Every expert's and the shared statistics in one layer file (tests and small models; requantize reads
    `LayerStatsFile` one expert at a time)."""
    file = LayerStatsFile(path)
    out = LayerExpertStats(file.layer)
    for key in file.keys():
        parts = key.split(".")
        if parts[0] == "experts" and len(parts) == 3 and parts[2] in (GATE_UP, DOWN):
            out.experts[(int(parts[1]), parts[2])] = file.expert(int(parts[1]), parts[2])
        elif parts[0] == "shared" and len(parts) == 2:
            out.shared[parts[1]] = file.shared(parts[1])
        else:
            raise CheckpointError(f"unexpected statistics {key}", file=file.path)
    return out


def read_layer_counts(path: Path) -> LayerStatsCounts:
    with safe_open(str(path), framework="pt") as f:
        return LayerStatsCounts.model_validate(json.loads((f.metadata() or {})[_COUNTS_KEY]))


__all__ = [
    "EXPERT_STATS_DIR",
    "ExpertStatsMode",
    "InMemoryLayerStats",
    "LayerExpertStats",
    "LayerStatsFile",
    "LayerStatsCounts",
    "layer_stats_name",
    "layer_stats_tensors",
    "read_layer_counts",
    "read_layer_stats",
    "write_layer_stats",
]
