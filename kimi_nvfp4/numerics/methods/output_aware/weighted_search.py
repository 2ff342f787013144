"""Per block, the E4M3 scale with the least channel-energy-weighted squared error against the INT4 values.

The weight-error search's trick carries over: a 16-block's values are `s * q_j` with one group scale `s`, so the
error of element j under a block scale depends only on `k = |q_j|`, and the weighted block error is

    sum_j e_j * err(|q_j|)**2 = sum_k E_k * err_k**2,    E_k = sum of the energies e_j of the elements with |q_j| = k

with `err_k = k*s - e2m1(k*s/d) * d` formed by the fp32 operations of quantize/dequantize and widened to float64
(exactly), `d = float(bits) * weight_scale_2`. `err_k**2` is computed once per (distinct |s|, candidate, k) in a
float64 table; a block gathers 8 entries per candidate and adds `E_k * err_k**2` in a fixed pairwise order.

Candidates: the E4M3 values within one binade (`WINDOW`, +-8 bit steps) of the weight-error search's choice.
Measured on a 256x7168 K2.6-shaped matrix with heavy-tailed energies, the optimum over all 126 values lay inside
that window for all but 9e-6 of the blocks (weighted error 1e-5 above the exhaustive search's), while ~6% of the
blocks moved 5-7 steps down (about half the scale: finer steps for the high-energy elements, the largest one,
of low energy, clipped); +-4 steps would have left 10% of the blocks short (+18% error).

Selection starts from the search's choice and takes another candidate only if its weighted error is strictly
smaller (ties among the others go to the smaller scale), so a block never gets worse than the search's under the
energies used. Only elementwise float64 operations, gathers and fixed-order sums: the same bits on every device.
"""

from __future__ import annotations

import torch

from ...constants import NVFP4_BLOCK_SIZE
from ...e2m1 import round_e2m1_magnitude
from ...e4m3 import E4M3_MAX_BITS, E4M3_MIN_POSITIVE_BITS, e4m3_bits_to_fp32
from ...nvfp4 import NVFP4Tensor
from ..int4_matrix import Int4Matrix
from ..search.cpu_tables import BlockKeys, cpu_tables_apply
from ..search.encode import encode_by_lookup, encode_rows
from ..search.reference import MAGNITUDES, flat_blocks
from .output_error import fixed_order_sum

__all__ = [
    "ENERGY_DAMPING",
    "WINDOW",
    "damped_energy",
    "energy_histogram",
    "refine_by_channel_energy",
    "weighted_block_bits",
]

# Added to every channel's energy, as a fraction of the mean (GPTQ's `percdamp` on H's diagonal): channels that
# calibration barely excited still count a little, so a scale is not chosen that is arbitrarily bad for them.
ENERGY_DAMPING = 0.01
# Candidate E4M3 bit offsets around the search's choice (8 steps = one binade; see the module docstring).
WINDOW = (-8, 8)
# Blocks per step of the search: the gathered [18, blocks, 8] float64 entries stay ~75 MB.
_BLOCKS_PER_STEP = 1 << 16


def damped_energy(energy: torch.Tensor, damping: float = ENERGY_DAMPING) -> torch.Tensor:
    """`energy + damping * mean(energy)` (float64; the mean as a fixed-order sum, identical on every device)."""
    energy = energy.to(torch.float64)
    return energy + damping * (fixed_order_sum(energy) / max(1, energy.numel()))


def energy_histogram(codes: torch.Tensor, energy: torch.Tensor) -> torch.Tensor:
    """float64 `[B, 8]`: per 16-block (row-major), the summed `energy` of its elements with |q| = 1..8.

    :param codes: int8 `[rows, in]`; :param energy: float64 `[in]`.
    """
    rows, in_features = codes.shape
    magnitude = codes.to(torch.int16).abs().view(rows, in_features // NVFP4_BLOCK_SIZE, NVFP4_BLOCK_SIZE)
    block_energy = energy.view(1, -1, NVFP4_BLOCK_SIZE)
    zero = torch.zeros((), dtype=torch.float64, device=codes.device)
    columns = [fixed_order_sum(torch.where(magnitude == k, block_energy, zero)) for k in MAGNITUDES]
    return torch.stack(columns, dim=-1).view(-1, len(MAGNITUDES))


def _error_table(scales: torch.Tensor, bits: torch.Tensor, weight_scale_2: torch.Tensor) -> torch.Tensor:
    """float64 `[len(bits) * U, 8]`: `err_k**2` for rows (candidate bits, distinct |scale|)."""
    magnitudes = torch.tensor(MAGNITUDES, dtype=torch.float32, device=scales.device)
    values = scales.unsqueeze(-1) * magnitudes  # [U, 8], exact
    divisor = (e4m3_bits_to_fp32(bits) * weight_scale_2).view(-1, 1, 1)  # [C, 1, 1]
    dequantized = round_e2m1_magnitude(values.unsqueeze(0) / divisor) * divisor  # [C, U, 8], as dequantize forms it
    error = values.double().unsqueeze(0) - dequantized.double()
    return (error * error).reshape(-1, len(MAGNITUDES))


def weighted_block_bits(
    m: Int4Matrix, search_bits: torch.Tensor, weight_scale_2: torch.Tensor, energy: torch.Tensor,
    window: tuple[int, int] = WINDOW,
) -> torch.Tensor:
    """uint8 `[out, in/16]`: each block's scale minimising the `energy`-weighted error (module docstring).

    :param search_bits: the weight-error search's block scales (uint8 `[out, in/16]`), the starting point.
    :param energy: float64 `[in]` per-channel weights (already damped if wanted).
    :param window: lowest and highest E4M3 bit offset tried around `search_bits`.
    """
    _, block_scale = flat_blocks(m.codes, m.group_scale)
    scales, scale_index = torch.unique(block_scale.abs(), return_inverse=True)
    histogram = energy_histogram(m.codes, energy.to(m.device))
    search_bits = search_bits.reshape(-1)
    offsets = torch.arange(window[0], window[1] + 1, dtype=torch.int16, device=m.device).unsqueeze(1)
    every = torch.arange(E4M3_MIN_POSITIVE_BITS, E4M3_MAX_BITS + 1, dtype=torch.uint8, device=m.device)
    table = _error_table(scales, every, weight_scale_2)  # all positive E4M3 values: any candidate is a row
    unique = scales.numel()
    chosen = torch.empty_like(search_bits)
    inf = torch.tensor(float("inf"), dtype=torch.float64, device=m.device)
    for start in range(0, search_bits.numel(), _BLOCKS_PER_STEP):
        part = slice(start, start + _BLOCKS_PER_STEP)
        start_bits = search_bits[part].unsqueeze(0)
        window_bits = (start_bits.to(torch.int16) + offsets).clamp(E4M3_MIN_POSITIVE_BITS, E4M3_MAX_BITS)
        bits = torch.cat([start_bits, window_bits.to(torch.uint8)])  # the search's choice first, then ascending
        rows = (bits.to(torch.int64) - E4M3_MIN_POSITIVE_BITS) * unique + scale_index[part]
        weighted = table.index_select(0, rows.reshape(-1)).view(*rows.shape, len(MAGNITUDES)) * histogram[part]
        errors = fixed_order_sum(weighted)  # [1 + C, n]
        errors = torch.where(torch.isnan(errors), inf, errors)
        best = errors.amin(dim=0)
        # The search's choice unless another is strictly better; among those, the first (smallest scale for
        # candidates in ascending order) equal to the minimum.
        first = torch.argmax((errors[1:] == best).to(torch.uint8), dim=0)
        other = torch.gather(bits[1:], 0, first.unsqueeze(0)).squeeze(0)
        chosen[part] = torch.where(errors[0] <= best, bits[0], other)
    return chosen.view(m.shape[0], m.shape[1] // NVFP4_BLOCK_SIZE)


def refine_by_channel_energy(
    m: Int4Matrix, search: NVFP4Tensor, energy: torch.Tensor, window: tuple[int, int] = WINDOW
) -> NVFP4Tensor:
    """`search` with each block's scale re-chosen by `weighted_block_bits` (same tensor scale), encoded."""
    scale_2 = search.weight_scale_2.to(m.device)
    bits = weighted_block_bits(m, search.weight_scale.view(torch.uint8).to(m.device), scale_2, energy, window)
    packed = encode_by_lookup(m, BlockKeys.of(m), bits, scale_2) if cpu_tables_apply(m) else encode_rows(m, bits, scale_2)
    return NVFP4Tensor(packed, bits.view(torch.float8_e4m3fn), scale_2)
