"""What a block-scale search returns: per matrix (`SearchResult`) and per scale group (`GroupChoice`).

Everything stays on the matrices' device, nothing is read back, so a GPU conversion never waits for Python.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["GroupChoice", "SearchResult"]


@dataclass
class SearchResult:
    """One matrix searched under the search's tensor scale, with Model Optimizer's rule under its own beside it.

    `chosen_bits`, `baseline_bits`: uint8 E4M3 bit patterns `[out, in/16]` (the search's choice; Model
    Optimizer's amax/6 rule under the baseline tensor scale). `chosen_error`, `baseline_error`: float64 0-d sums
    of the blocks' squared errors against the INT4 values, each block's fp32 error added in row chunks (the order
    is part of the result: every path adds in the same order).
    """

    chosen_bits: torch.Tensor
    baseline_bits: torch.Tensor
    chosen_error: torch.Tensor
    baseline_error: torch.Tensor


@dataclass
class GroupChoice:
    """The final block scales of a scale group (matrices sharing one `weight_scale_2`).

    `bits[i]`: uint8 `[out, in/16]` of matrix i; `weight_scale_2`: float32 0-d; `fell_back`: bool 0-d, set when
    the group kept Model Optimizer's result because the search's summed error was larger (never observed; the
    tensor scales differ, so per-block dominance does not carry over to whole matrices by construction). For the
    `amax` method itself it is set too: its result IS Model Optimizer's.
    """

    bits: list[torch.Tensor]
    weight_scale_2: torch.Tensor
    fell_back: torch.Tensor
