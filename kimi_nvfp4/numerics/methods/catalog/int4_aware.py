"""`int4-aware` (the default): per block, the best of seven E4M3 scales derived from the INT4 codes and group scale.

Targets for `d = E4M3 scale * weight_scale_2`, each tried at its rounded E4M3 value plus neighbour bit offsets
(docs/numerics.md, "Why these candidates": measured on synthetic K2.6 experts, these seven reach ~1.01x the
exhaustive per-block optimum; all 9 +-1 neighbours ~1.002x):
  block_amax / 6  {0, +1}     Model Optimizer's rule (keeping it makes the method never worse than `amax` per block)
  block_amax / 4  {-1, 0, +1} Four Over Six (the largest |code| on E2M1 4, finer steps below it)
  2 * s_group     {-1, 0}     INT4-aligned: codes 0, +-1..4, +-6, -8 exact; s_group for blocks with |code|max <= 6
Tensor scale: the power of two at or above amax / (448 * 3.5) (`INT4_AWARE_RULE.tensor_scale_headroom`), so the
largest block can use 2 * s_group and `b * weight_scale_2` is exact.
"""

from __future__ import annotations

from ...constants import E2M1_MAX
from ..registry import ScaleMethodSpec
from ..search.group import BlockSearch
from ..search.rule import AlignedTarget, AmaxFractionTarget, CandidateRule

FOUR_OVER_SIX_DIVISOR = 4.0  # the largest |value| on E2M1 4
# |code| >= 7 needs 2 * s_group (7 -> 3.5 -> 4, 8 -> 4 on the grid of 2s); below that, s_group dominates.
INT4_ALIGNED_WIDE_FROM_CODE = 7
INT4_ALIGNED_WIDE_MULTIPLE = 2.0

INT4_AWARE_RULE = CandidateRule(
    fractions=(
        AmaxFractionTarget(divisor=E2M1_MAX, lowest=0, highest=1),
        AmaxFractionTarget(divisor=FOUR_OVER_SIX_DIVISOR, lowest=-1, highest=1),
    ),
    aligned=AlignedTarget(
        wide_from_code=INT4_ALIGNED_WIDE_FROM_CODE, wide_multiple=INT4_ALIGNED_WIDE_MULTIPLE, lowest=-1, highest=0
    ),
)
INT4_AWARE_SEARCH = BlockSearch(INT4_AWARE_RULE, INT4_AWARE_RULE.tensor_scale_headroom)

PLUGIN = ScaleMethodSpec(
    name="int4-aware",
    description=(
        "per 16-value block, the best of a few E4M3 scales derived from the INT4 codes and group scale (ModelOpt's "
        "amax/6, Four Over Six's amax/4, and the INT4-aligned 2x group scale under which codes 0, ±1..4, ±6, -8 are "
        "exact), chosen by error against the INT4 values; never worse than `amax`."
    ),
    search=INT4_AWARE_SEARCH,
)
