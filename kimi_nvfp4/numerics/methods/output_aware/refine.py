"""The one place where an output-aware method runs: statistics fallback, batching, and the never-worse guard.

For each expert (its matrices that read one input: gate+up, or down):

1. the method's weight-error search (`ScaleMethodSpec.search`, int4-aware) gives the starting NVFP4 tensors;
2. `choose_statistics` picks what the refinement optimises against (see below) and says where it came from;
3. experts with equal shapes and the same kind of statistics (dense or diagonal) are handed to the method's
   `refine` together (`batch_experts` at a time), so a method can batch them on the device (GPTQ does);
4. the guard: per matrix, the refinement's calibration-weighted output error (`output_error`, under the statistics
   used) is compared with the search's, and the search's result is kept unless the refinement's is not larger.
   So no matrix ends with a larger weighted output error than int4-aware's, whatever the method does.

Statistics fallback, in order (thresholds below; `RefineSummary.counts` reports how many experts took each):
  expert-dense      the expert's own dense Hessian, if the method wants one and it saw enough tokens for it;
  expert-diagonal   the expert's own channel energies, if it saw enough tokens for those;
  shared-dense      the layer's statistics of the same input (gate/up: every token's hidden state), dense
  shared-diagonal   or diagonal, when the caller has them (there are none for down: each expert's intermediate
                    space is its own, so pooling experts would mix unrelated channels);
  none              nothing usable: the search's result is kept.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum

from ...nvfp4 import NVFP4Tensor
from ..int4_matrix import Int4Matrix
from ..search.group import BlockSearch, choose_path, quantize_group
from .input_stats import ExpertInputStats
from .output_error import output_error

__all__ = [
    "DENSE_MIN_TOKENS_PER_CHANNEL",
    "DIAGONAL_MIN_TOKENS",
    "ExpertMatrices",
    "RefineInput",
    "RefineSummary",
    "RefinedExpert",
    "StatisticsSource",
    "choose_statistics",
    "refine_experts",
]

# A dense Hessian of an expert whose tokens are fewer than this many per input channel is not trusted: with
# n rows, X^T X has rank <= n, and GPTQ then pushes errors into directions calibration never saw, which held-out
# tokens do excite (measured: bench/quality/output_aware.py, docs/numerics.md "Output-aware methods").
DENSE_MIN_TOKENS_PER_CHANNEL = 1.0
# Below this many tokens even the channel energies are too noisy to weight by (measured as above).
DIAGONAL_MIN_TOKENS = 64
# Experts handed to a method's `refine` at once (GPTQ's batched Cholesky and column loop).
BATCH_EXPERTS = 8


class StatisticsSource(str, Enum):
    """Which statistics an expert's refinement optimised against (module docstring)."""

    EXPERT_DENSE = "expert-dense"
    EXPERT_DIAGONAL = "expert-diagonal"
    SHARED_DENSE = "shared-dense"
    SHARED_DIAGONAL = "shared-diagonal"
    NONE = "none"


@dataclass
class ExpertMatrices:
    """One expert's matrices that read the same input rows (gate+up, which also share a tensor scale; or down).

    :param stats: what calibration saw at this input for this expert (None: nothing).
    :param shared_stats: the layer's statistics of the same input over all tokens (gate/up only), or None.
    """

    name: str
    matrices: list[Int4Matrix]
    stats: ExpertInputStats | None
    shared_stats: ExpertInputStats | None = None


@dataclass
class RefineInput:
    """What a method's `refine` receives per expert: the INT4 matrices, the search's NVFP4 tensors (one tensor
    scale), and the statistics to optimise against (after the fallback; dense or diagonal).

    :param shared: where `stats` are the expert's own, the layer's statistics of the same input over all tokens
        (`ExpertMatrices.shared_stats`, gate/up only; on their own device, not moved), which a method may pool
        with the expert's (gptq's `pool_tokens`); None otherwise."""

    matrices: list[Int4Matrix]
    search: list[NVFP4Tensor]
    stats: ExpertInputStats
    shared: ExpertInputStats | None = None


Refiner = Callable[[Sequence[RefineInput]], list[list[NVFP4Tensor]]]


@dataclass
class RefinedExpert:
    """One expert's result: final tensors, the statistics used, and per matrix whether the search's result was
    kept (the refinement was not better) and both weighted output errors (0.0 where no statistics)."""

    name: str
    tensors: list[NVFP4Tensor]
    source: StatisticsSource
    kept_search: list[bool]
    search_error: list[float]
    final_error: list[float]


@dataclass
class RefineSummary:
    experts: list[RefinedExpert] = field(default_factory=list)

    def counts(self) -> dict[str, int]:
        """Experts per statistics source, and matrices that kept the search's result."""
        counts = {s.value: sum(e.source is s for e in self.experts) for s in StatisticsSource}
        counts["matrices_kept_search"] = sum(sum(e.kept_search) for e in self.experts)
        return counts


def _enough_for_dense(stats: ExpertInputStats | None) -> bool:
    return stats is not None and stats.hessian is not None and stats.tokens >= DENSE_MIN_TOKENS_PER_CHANNEL * stats.in_features


def _enough_for_diagonal(stats: ExpertInputStats | None) -> bool:
    return stats is not None and stats.tokens >= DIAGONAL_MIN_TOKENS


def choose_statistics(expert: ExpertMatrices, dense: bool) -> tuple[ExpertInputStats | None, StatisticsSource]:
    """The statistics an expert's refinement uses and their source (module docstring); `dense`: the method wants
    a dense Hessian where there is a trustworthy one."""
    if dense and _enough_for_dense(expert.stats):
        return expert.stats, StatisticsSource.EXPERT_DENSE
    if _enough_for_diagonal(expert.stats):
        return expert.stats.diagonal(), StatisticsSource.EXPERT_DIAGONAL
    if dense and _enough_for_dense(expert.shared_stats):
        return expert.shared_stats, StatisticsSource.SHARED_DENSE
    if _enough_for_diagonal(expert.shared_stats):
        return expert.shared_stats.diagonal(), StatisticsSource.SHARED_DIAGONAL
    return None, StatisticsSource.NONE


def refine_experts(
    search: BlockSearch, refine: Refiner, experts: Sequence[ExpertMatrices], *, dense: bool,
    batch_experts: int = BATCH_EXPERTS,
) -> RefineSummary:
    """Run an output-aware method over experts (module docstring). Results stay on the matrices' device.

    :param search: the method's weight-error search; :param refine: its refinement; :param dense: it wants dense
    Hessians. (`requantize_experts` passes these from a registered method.)
    """
    pending: dict[tuple, list[tuple[int, RefineInput]]] = {}
    results: list[RefinedExpert | None] = []
    sources: dict[int, StatisticsSource] = {}
    for index, expert in enumerate(experts):
        mats = expert.matrices
        if len({m.shape[1] for m in mats}) != 1:
            raise ValueError(f"{expert.name}: matrices refined together must read one input width")
        searched, _ = quantize_group(mats, search, choose_path(mats, search))
        stats, source = choose_statistics(expert, dense)
        if stats is not None and stats.in_features != mats[0].shape[1]:
            raise ValueError(f"{expert.name}: statistics of width {stats.in_features}, matrices read {mats[0].shape[1]}")
        if stats is None:
            zeros = [0.0] * len(mats)
            results.append(RefinedExpert(expert.name, searched, source, [True] * len(mats), zeros, list(zeros)))
            continue
        results.append(None)
        key = (tuple(m.shape for m in mats), stats.hessian is not None, mats[0].device)
        own = source in (StatisticsSource.EXPERT_DENSE, StatisticsSource.EXPERT_DIAGONAL)
        pending.setdefault(key, []).append(
            (index, RefineInput(mats, searched, stats.to(mats[0].device), expert.shared_stats if own else None)))
        sources[index] = source
    for items in pending.values():
        for start in range(0, len(items), batch_experts):
            batch = items[start : start + batch_experts]
            proposals = refine([item for _, item in batch])
            for (index, item), proposal in zip(batch, proposals):
                results[index] = _guarded(experts[index].name, item, proposal, sources[index])
    return RefineSummary([r for r in results if r is not None])


def _guarded(name: str, item: RefineInput, proposal: list[NVFP4Tensor], source: StatisticsSource) -> RefinedExpert:
    tensors, kept, before, after = [], [], [], []
    for m, searched, refined in zip(item.matrices, item.search, proposal):
        search_error = float(output_error(m, searched, item.stats))
        refined_error = float(output_error(m, refined, item.stats))
        keep = not refined_error <= search_error  # NaN keeps the search's result too
        tensors.append(searched if keep else refined)
        kept.append(keep)
        before.append(search_error)
        after.append(search_error if keep else refined_error)
    return RefinedExpert(name, tensors, source, kept, before, after)
