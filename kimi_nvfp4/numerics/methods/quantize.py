"""INT4 matrices -> NVFP4 tensors with a chosen scale-selection method.

All matrices passed together share one weight_scale_2: SGLang keeps only gate's (w1) scale for the
fused gate/up (w13) weight of an expert (srt/layers/quantization/modelopt_quant.py,
ModelOptNvFp4FusedMoEMethod.process_weights_after_loading), so convert passes gate and up together.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..constants import E4M3_MAX, NVFP4_BLOCK_SIZE
from ..e2m1 import pack_e2m1
from ..e4m3 import (
    E4M3_NUM_POSITIVE,
    e4m3_from_bits,
)
from ..nvfp4 import (
    ZERO_BLOCK_SCALE,
    NVFP4Tensor,
    divide_exactly,
    encode_with_block_scales,
    quantize_nvfp4,
    tensor_scale_from_amax,
    tensor_scales_from_amax,
)
from .block_search import (
    ErrorTable,
    block_max_code,
    candidate_errors,
    distinct_sorted,
    flat_blocks,
    magnitude_histogram,
    magnitude_histogram_packed,
    select_best,
)
from .candidates import (
    INT4_AWARE_CANDIDATES,
    all_positive_bits,
    int4_aware_bits,
    model_optimizer_bits,
)
from .lut import BlockKeys, block_scale_ids, code_bytes, encode_blocks, lut_eligible
from .lut_search import KeyTable, key_bits, search_by_key
from .types import Int4Matrix, ScaleMethod

__all__ = [
    "DEFAULT_METHOD",
    "amax_block_bits",
    "quantize_int4_matrices",
    "search_block_scales",
    "shared_tensor_scale",
]

DEFAULT_METHOD = ScaleMethod.INT4_AWARE

# Upper bound on elements of the largest temporary ([candidates, 8, blocks] fp32) per step:
# 2**24 * 4 B = 64 MiB, so a [7168, 2048] matrix never needs 126x its size.
# On CUDA 16x that (1 GiB), so a whole K2.6 expert matrix is one step: fewer launches, same choices
# (blocks are independent; only the float64 error totals' summation order follows the steps).
_WORK_ELEMENTS = {"cpu": 1 << 24, "cuda": 1 << 28}
# Elements per step of the encode passes (a few fp32 temporaries of rows x in): 2048 rows of K2.6's
# 7168-wide gate/up on CPU; 8x that on CUDA, where each step is a handful of kernel launches and
# a [4096, 7168] gate+up stack then runs in one step. Rows are independent: bytes do not depend on it.
_ENCODE_STEP_ELEMENTS = {"cpu": 2048 * 7168, "cuda": 8 * 2048 * 7168}


def _row_step(m: Int4Matrix) -> int:
    budget = _ENCODE_STEP_ELEMENTS.get(m.device.type, _ENCODE_STEP_ELEMENTS["cpu"])
    return max(1, budget // max(1, m.shape[1]))
_MAGNITUDE_CLASSES = 8
# block_amax / 3.5 = 2 * s_group for a block whose largest |code| is 7 (SPEC §3).
INT4_AWARE_HEADROOM = 3.5


def shared_tensor_scale(mats: Sequence[Int4Matrix], method: ScaleMethod | str = ScaleMethod.AMAX) -> torch.Tensor:
    """One weight_scale_2 for all `mats`, from their largest |value|.

    AMAX: Model Optimizer's amax / (6 * 448). INT4_AWARE and SWEEP: the power of two at or above
    amax / (448 * 3.5). The headroom lets the largest blocks use d = 2 * s_group (|q|max 7 needs
    block_amax / 3.5, beyond amax/6's ceiling of 448); the power of two makes `e4m3 * weight_scale_2`
    exact, so `2 * s_group` is itself a block scale whenever `s_group` has at most 3 mantissa bits.
    """
    method = ScaleMethod(method)
    amax = torch.stack([m.amax() for m in mats]).amax()
    if method is ScaleMethod.AMAX:
        return tensor_scale_from_amax(amax)
    return power_of_two_tensor_scale(amax)


def power_of_two_tensor_scale(amax: torch.Tensor) -> torch.Tensor:
    """The smallest power of two at or above `amax / (448 * 3.5)` (float32, same shape as `amax`), computed
    on `amax`'s device without reading it back; `amax <= 0` gets Model Optimizer's `amax / 2688` rule.

    `frexp` gives x = m * 2**e with m in [0.5, 1), so ceil(log2(x)) is e, or e - 1 when m is exactly 0.5
    (x a power of two): exact integer arithmetic, where a float log2 can round an x just above a power of
    two down onto it. The float64 quotient is correctly rounded on every device (`divide_exactly`).
    """
    ratio = divide_exactly(amax.to(torch.float64), E4M3_MAX * INT4_AWARE_HEADROOM)
    mantissa, exponent = torch.frexp(ratio)
    exponent = exponent - (mantissa == 0.5).to(exponent.dtype)
    scale = torch.ldexp(torch.ones_like(ratio), exponent).to(torch.float32)
    return torch.where(amax > 0, scale, tensor_scales_from_amax(amax))


def _candidate_bits(method: ScaleMethod, block_codes, block_scale, weight_scale_2) -> torch.Tensor:
    if method is ScaleMethod.SWEEP:
        return all_positive_bits(block_scale.shape[0], block_scale.device)
    return int4_aware_bits(block_max_code(block_codes), block_scale, weight_scale_2)


def amax_block_bits(block_codes: torch.Tensor, block_scale: torch.Tensor, weight_scale_2: torch.Tensor) -> torch.Tensor:
    """Model Optimizer's block scale (amax/6 rule) as one candidate `[1, B]`, from codes and group scale.

    Same fp32 operations as `NVFP4QTensor.get_weights_scaling_factor`: block_amax / (6 * weight_scale_2).
    """
    return model_optimizer_bits(block_max_code(block_codes), block_scale, weight_scale_2).unsqueeze(0)


def search_block_scales(
    m: Int4Matrix,
    weight_scale_2: torch.Tensor,
    method: ScaleMethod,
    baseline_scale_2: torch.Tensor | None = None,
) -> tuple[torch.Tensor, float, float]:
    """Block scales `[out, in/16]` (float8_e4m3fn) chosen by `method` (INT4_AWARE or SWEEP).

    Also returns the summed block error of the choice and, when `baseline_scale_2` is given, of
    Model Optimizer's amax rule under that tensor scale (0.0 otherwise), so callers can fall back.
    """
    chosen, _, chosen_error, baseline_error = search_block_bits(m, weight_scale_2, method, baseline_scale_2)
    chosen_total, baseline_total = torch.stack([chosen_error, baseline_error]).tolist()
    return e4m3_from_bits(chosen), chosen_total, baseline_total


def search_block_bits(
    m: Int4Matrix,
    weight_scale_2: torch.Tensor,
    method: ScaleMethod,
    baseline_scale_2: torch.Tensor | None = None,
    *,
    per_block: bool = False,
    keys: BlockKeys | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """The search behind `search_block_scales`, nothing read back: chosen bits uint8 `[out, in/16]`, Model
    Optimizer's bits under `baseline_scale_2` (None without one), and the float64 0-d error totals of both.

    Block errors come from a table of the matrix's distinct scales (`ErrorTable`, fastest on CPU; sizing it
    reads the number of distinct scales back), or with `per_block` straight from each block
    (`candidate_errors`, no read-back: the GPU path). Both are the same fp32 operations, so the same
    candidates win. Error totals accumulate on the device (float64 adds in chunk order).
    On the CPU, INT4_AWARE looks a row of all candidates up per block instead (`lut_search.py`: the same
    bits and totals); `keys` are the matrix's `BlockKeys` when the caller already has them.
    """
    out_features, in_features = m.shape
    blocks_per_row = in_features // NVFP4_BLOCK_SIZE
    candidates = E4M3_NUM_POSITIVE if method is ScaleMethod.SWEEP else INT4_AWARE_CANDIDATES
    work = _WORK_ELEMENTS.get(m.device.type, _WORK_ELEMENTS["cpu"])
    row_chunk = max(1, work // max(1, blocks_per_row * candidates * _MAGNITUDE_CLASSES))
    if method is ScaleMethod.INT4_AWARE and not per_block and keys is None and lut_eligible(m):
        keys = BlockKeys.of(m)
    if method is ScaleMethod.INT4_AWARE and keys is not None:
        table = KeyTable(keys.values, weight_scale_2, baseline_scale_2)
        if table.usable():  # the same bits and totals as below (lut_search.py)
            return search_by_key(keys, table, row_chunk)
    chosen = torch.empty((out_features * blocks_per_row,), dtype=torch.uint8, device=m.device)
    baseline = torch.empty_like(chosen) if baseline_scale_2 is not None else None
    one = torch.tensor(ZERO_BLOCK_SCALE, dtype=torch.float8_e4m3fn, device=m.device).view(torch.uint8)
    chosen_error = torch.zeros((), dtype=torch.float64, device=m.device)
    baseline_error = torch.zeros((), dtype=torch.float64, device=m.device)
    table = baseline_table = scale_index = None
    if not per_block:
        distinct = distinct_sorted(m.group_scale.abs())
        table = ErrorTable(m.group_scale, weight_scale_2, distinct)
        if baseline_scale_2 is not None:
            baseline_table = ErrorTable(m.group_scale, baseline_scale_2, distinct)
    for start in range(0, out_features, row_chunk):
        stop = min(out_features, start + row_chunk)
        block_codes, block_scale = flat_blocks(m.codes[start:stop], m.group_scale[start:stop])
        bits = _candidate_bits(method, block_codes, block_scale, weight_scale_2)
        if per_block:
            histogram = magnitude_histogram_packed(block_codes)  # a scatter-add serialises on CUDA atomics
        else:
            histogram = magnitude_histogram(block_codes)
            scale_index = table.block_scale_index(start, stop)
        errors = _block_errors(table, histogram, block_scale, scale_index, bits, weight_scale_2)
        best, best_error = select_best(errors, bits)
        chosen_error = chosen_error + best_error.double().sum()
        if baseline is not None:
            baseline_bits = amax_block_bits(block_codes, block_scale, baseline_scale_2)
            errors = _block_errors(baseline_table, histogram, block_scale, scale_index, baseline_bits, baseline_scale_2)
            baseline_error = baseline_error + errors.double().sum()
            baseline[start * blocks_per_row : stop * blocks_per_row] = baseline_bits[0]
        # An all-zero block is exact under any scale; keep Model Optimizer's 1.0 for it.
        zero = (histogram.sum(dim=0) == 0) | (block_scale == 0)
        chosen[start * blocks_per_row : stop * blocks_per_row] = torch.where(zero, one, best)
    shape = (out_features, blocks_per_row)
    return chosen.reshape(shape), None if baseline is None else baseline.reshape(shape), chosen_error, baseline_error


def _block_errors(
    table: ErrorTable | None, histogram: torch.Tensor, block_scale: torch.Tensor, scale_index: torch.Tensor | None,
    bits: torch.Tensor, weight_scale_2: torch.Tensor,
) -> torch.Tensor:
    """Squared error `[C, B]` of each candidate: from `table` when there is one, else per block (same values)."""
    if table is None:
        return candidate_errors(histogram, block_scale, bits, weight_scale_2)
    return table.errors(histogram, scale_index, bits)


def _encode_rows(
    m: Int4Matrix, block_scale: torch.Tensor, weight_scale_2: torch.Tensor, keys: BlockKeys | None = None
) -> torch.Tensor:
    """NVFP4 bytes of `m` under `block_scale` (e4m3 `[out, in/16]`): by byte lookup on the CPU (`lut.py`, the
    same bytes), else `encode_with_block_scales` on row steps."""
    if keys is not None or lut_eligible(m):
        values, block_id = (keys.values, keys.block_id) if keys is not None else block_scale_ids(m)
        return encode_blocks(code_bytes(m), values, block_id, block_scale.view(torch.uint8), weight_scale_2)
    packed = torch.empty((m.shape[0], m.shape[1] // 2), dtype=torch.uint8, device=m.device)
    step = _row_step(m)
    for start in range(0, m.shape[0], step):
        stop = min(m.shape[0], start + step)
        values = m.rows(start, stop).values()
        packed[start:stop] = pack_e2m1(encode_with_block_scales(values, block_scale[start:stop], weight_scale_2))
    return packed


def _quantize_amax(m: Int4Matrix, weight_scale_2: torch.Tensor, keys: BlockKeys | None = None) -> NVFP4Tensor:
    if keys is None and lut_eligible(m):
        keys = BlockKeys.of(m)
    if keys is not None:  # Model Optimizer's bits per (scale, largest |q|), then byte lookup: the same bytes
        bits = key_bits(keys, model_optimizer_bits, weight_scale_2).view(keys.block_id.shape)
        weight = encode_blocks(code_bytes(m), keys.values, keys.block_id, bits, weight_scale_2)
        return NVFP4Tensor(weight, e4m3_from_bits(bits), weight_scale_2)
    weights, scales = [], []
    step = _row_step(m)
    for start in range(0, m.shape[0], step):
        part = quantize_nvfp4(m.rows(start, start + step).values(), weight_scale_2=weight_scale_2)
        weights.append(part.weight)
        scales.append(part.weight_scale)
    if len(weights) == 1:  # one step: no concatenation copy
        return NVFP4Tensor(weights[0], scales[0], weight_scale_2)
    return NVFP4Tensor(torch.cat(weights), torch.cat(scales), weight_scale_2)


def _quantize_amax_stacked(mats: Sequence[Int4Matrix], weight_scale_2: torch.Tensor) -> list[NVFP4Tensor]:
    """`_quantize_amax` of each matrix, run once over the rows of all matrices of one input width.

    With one shared weight_scale_2 every operation of the amax rule is row-local (block amax, block
    scale, codes), so stacking rows gives the same bytes with half the kernel launches for gate+up.
    """
    if len(mats) == 1 or len({m.shape[1] for m in mats}) != 1 or all(map(lut_eligible, mats)):
        return [_quantize_amax(m, weight_scale_2) for m in mats]
    stacked = Int4Matrix(torch.cat([m.codes for m in mats]), torch.cat([m.group_scale for m in mats]))
    whole = _quantize_amax(stacked, weight_scale_2)
    out, start = [], 0
    for m in mats:
        stop = start + m.shape[0]
        out.append(NVFP4Tensor(whole.weight[start:stop], whole.weight_scale[start:stop], weight_scale_2))
        start = stop
    return out


def quantize_int4_matrices(
    mats: Sequence[Int4Matrix], method: ScaleMethod | str = DEFAULT_METHOD
) -> list[NVFP4Tensor]:
    """Convert INT4 matrices that share ONE weight_scale_2 (an expert's gate+up, or a down alone)."""
    method = ScaleMethod(method)
    if not mats:
        return []
    devices = {m.device for m in mats}
    if len(devices) != 1:
        raise ValueError(f"matrices converted together must share a device, got {sorted(map(str, devices))}")
    # Both tensor scales from one amax (`shared_tensor_scale`'s rules); on the CPU from the blocks' keys.
    keys = [BlockKeys.of(m) for m in mats] if all(map(lut_eligible, mats)) else [None] * len(mats)
    amax = torch.stack([m.amax() if k is None else k.amax() for m, k in zip(mats, keys)]).amax()
    baseline_scale_2 = tensor_scale_from_amax(amax)
    if method is ScaleMethod.AMAX:
        if keys[0] is not None:
            return [_quantize_amax(m, baseline_scale_2, k) for m, k in zip(mats, keys)]
        return _quantize_amax_stacked(mats, baseline_scale_2)
    weight_scale_2 = power_of_two_tensor_scale(amax)
    searched = []
    for m, k in zip(mats, keys):
        chosen, _, chosen_error, baseline_error = search_block_bits(m, weight_scale_2, method, baseline_scale_2, keys=k)
        chosen_total, baseline_total = torch.stack([chosen_error, baseline_error]).tolist()
        searched.append((e4m3_from_bits(chosen), chosen_total, baseline_total))
    # The search tensor scale differs from Model Optimizer's, so block-wise dominance over `amax` does
    # not carry over to whole matrices by construction; compare the group's totals and keep amax's
    # result in the (never observed) case it is better. The totals are float64 sums of fp32 block
    # errors; their order may differ by device, which could only matter for a near-exact tie.
    if sum(e for _, e, _ in searched) > sum(b for _, _, b in searched):
        return [_quantize_amax(m, baseline_scale_2, k) for m, k in zip(mats, keys)]
    return [
        NVFP4Tensor(_encode_rows(m, block_scale, weight_scale_2, k), block_scale, weight_scale_2)
        for m, k, (block_scale, _, _) in zip(mats, keys, searched)
    ]
