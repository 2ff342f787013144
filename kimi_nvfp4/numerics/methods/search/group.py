"""The one place that picks an execution path, searches a scale group, applies the fallback and encodes it.

A scale group is the matrices that share one `weight_scale_2` (an expert's gate+up, or its down). Three paths
compute the same bytes (each tested bit-exact against the reference):

    REFERENCE   per-block torch ops (`reference.py`); any device; nothing read back. The definition.
    CPU_TABLES  byte lookups over the packed source (`cpu_tables.py`) and tables per distinct scale or per
                (scale, largest |code|) key (`scale_table.py`, `cpu_search.py`); CPU only, reads back freely.
    TRITON      two fused kernels per matrix (`triton_kernels.py`); CUDA with Triton installed.

`choose_path` decides, from the device, the matrices and the candidates alone; callers may request a path
(tests, benchmarks). Inside CPU_TABLES one data-dependent choice remains, made here too: the per-key table holds
a `CandidateRule` only while no block error can overflow (`KeyTable.usable`); otherwise, and for the sweep's 126
candidates, the per-scale table computes the same errors.

The group rule: Model Optimizer's tensor scale (amax / 2688) and block scales are always computed beside the
search's; the group keeps Model Optimizer's result when the search's summed error is larger (never observed:
the tensor scales differ, so per-block dominance does not carry over to whole matrices by construction). The
comparison is a device bool and the selection a `torch.where`, so no path reads anything back for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

import torch

from ...nvfp4 import NVFP4Tensor, tensor_scales_from_amax
from ...triton_support import triton_module
from ..int4_matrix import Int4Matrix
from ..stats import error_sums
from .cpu_search import KeyTable, key_bits
from .cpu_tables import BlockKeys, cpu_tables_apply
from .encode import encode_by_lookup, encode_rows
from .reference import error_total_rows, model_optimizer_block_bits, search_reference
from .result import GroupChoice, SearchResult
from .rule import CandidateRule, CandidateSet, power_of_two_tensor_scale
from .scale_table import search_by_scale_table

__all__ = ["BlockSearch", "SearchPath", "choose_path", "quantize_group", "search_group"]


class SearchPath(str, Enum):
    """How a group's search and encode are executed (same bytes on every path)."""

    REFERENCE = "reference"
    CPU_TABLES = "cpu-tables"
    TRITON = "triton"


@dataclass(frozen=True)
class BlockSearch:
    """A weight-error scale method as data.

    `candidates`: the block scales tried per block, or None for Model Optimizer's amax rule alone (under its own
    tensor scale). `tensor_scale_headroom`: the search's tensor scale is the power of two at or above
    amax / (448 * headroom) (`rule.power_of_two_tensor_scale`); unused without candidates.
    """

    candidates: CandidateSet | None
    tensor_scale_headroom: float = 1.0


def _triton_kernels():
    """The Triton kernels module, or None where Triton is not installed (e.g. CPU-only installs)."""
    return triton_module("methods.search.triton_kernels")


def choose_path(mats: Sequence[Int4Matrix], search: BlockSearch, requested: SearchPath | None = None) -> SearchPath:
    """The path for a group on `mats`' device: CPU_TABLES on the CPU when every matrix's bytes can be looked up
    (`cpu_tables_apply`: little-endian host, codes in [-8, 7], finite scales), TRITON on CUDA when Triton is
    installed and the kernel holds the candidates, REFERENCE otherwise. A `requested` path is checked."""
    device = mats[0].device
    cpu_tables = device.type == "cpu" and all(cpu_tables_apply(m) for m in mats)
    kernels = _triton_kernels() if device.type == "cuda" else None
    triton = kernels is not None and kernels.supports(search.candidates)
    if requested is None:
        return SearchPath.CPU_TABLES if cpu_tables else SearchPath.TRITON if triton else SearchPath.REFERENCE
    requested = SearchPath(requested)
    if (requested is SearchPath.CPU_TABLES and not cpu_tables) or (requested is SearchPath.TRITON and not triton):
        raise ValueError(f"the {requested.value} path does not serve these matrices on {device}")
    return requested


def _search(path: SearchPath, m: Int4Matrix, keys: BlockKeys | None, candidates: CandidateSet,
            weight_scale_2: torch.Tensor, baseline_scale_2: torch.Tensor) -> SearchResult:
    if path is SearchPath.TRITON:
        return _triton_kernels().search_blocks(m.codes, m.group_scale, weight_scale_2, baseline_scale_2, candidates)
    if path is SearchPath.CPU_TABLES:
        if isinstance(candidates, CandidateRule) and KeyTable.holds(candidates):
            table = KeyTable(keys.values, candidates, weight_scale_2, baseline_scale_2)
            if table.usable():
                return table.search(keys, error_total_rows(m, candidates.count))
        return search_by_scale_table(m, keys, weight_scale_2, baseline_scale_2, candidates)
    return search_reference(m, weight_scale_2, baseline_scale_2, candidates)


def _model_optimizer_bits(path: SearchPath, m: Int4Matrix, keys: BlockKeys | None, scale_2: torch.Tensor):
    if path is SearchPath.TRITON:
        return _triton_kernels().model_optimizer_bits(m.codes, m.group_scale, scale_2)
    if path is SearchPath.CPU_TABLES:
        return key_bits(keys, scale_2)
    return model_optimizer_block_bits(m, scale_2)


def search_group(
    mats: Sequence[Int4Matrix], search: BlockSearch, path: SearchPath, keys: Sequence[BlockKeys | None]
) -> GroupChoice:
    """The group's final block scales and tensor scale (see the module docstring); nothing read back."""
    amax = torch.stack([m.amax() if k is None else k.amax() for m, k in zip(mats, keys)]).amax()
    baseline_scale_2 = tensor_scales_from_amax(amax)
    if search.candidates is None:
        bits = [_model_optimizer_bits(path, m, k, baseline_scale_2) for m, k in zip(mats, keys)]
        return GroupChoice(bits, baseline_scale_2, torch.ones((), dtype=torch.bool, device=amax.device))
    weight_scale_2 = power_of_two_tensor_scale(amax, search.tensor_scale_headroom)
    results = [_search(path, m, k, search.candidates, weight_scale_2, baseline_scale_2) for m, k in zip(mats, keys)]
    # Totals are added one matrix at a time, in order (as Python's `sum` of floats would).
    chosen_total = torch.zeros((), dtype=torch.float64, device=amax.device)
    baseline_total = torch.zeros_like(chosen_total)
    for r in results:
        chosen_total = chosen_total + r.chosen_error
        baseline_total = baseline_total + r.baseline_error
    fell_back = chosen_total > baseline_total
    bits = [torch.where(fell_back, r.baseline_bits, r.chosen_bits) for r in results]
    return GroupChoice(bits, torch.where(fell_back, baseline_scale_2, weight_scale_2), fell_back)


def quantize_group(
    mats: Sequence[Int4Matrix], search: BlockSearch, path: SearchPath, *, record_stats: bool = False
) -> tuple[list[NVFP4Tensor], list[torch.Tensor | None]]:
    """NVFP4 tensors of a scale group on `path`, and with `record_stats` each matrix's `stats.error_sums` row."""
    keys = [BlockKeys.of(m) if path is SearchPath.CPU_TABLES else None for m in mats]
    choice = search_group(mats, search, path, keys)
    scale_2 = choice.weight_scale_2
    tensors, rows = [], []
    for m, k, bits in zip(mats, keys, choice.bits):
        row = None
        if path is SearchPath.TRITON:
            packed, row = _triton_kernels().encode_blocks(m.codes, m.group_scale, bits, scale_2, stats=record_stats)
        elif k is not None:
            packed = encode_by_lookup(m, k, bits, scale_2)
        else:
            packed = encode_rows(m, bits, scale_2)
        q = NVFP4Tensor(packed, bits.view(torch.float8_e4m3fn), scale_2)
        tensors.append(q)
        rows.append(row if row is not None or not record_stats else error_sums(m, q))
    return tensors, rows
