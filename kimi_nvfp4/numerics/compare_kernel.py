"""Validate's weight check as one fused Triton kernel per matrix: INT4 source against NVFP4 output, read packed.

`stats.error_sums` (the reference, and the CPU path) unpacks the INT4 codes, dequantizes both matrices to fp32 and
runs about fifteen kernels per matrix over fp32 temporaries; a K2.6 MoE layer has 1,152 expert matrices, so on the
H200 the check cost ~1.4 s per layer (docs/benchmarks.md §10, session 6). Here one program reads 128 16-element
blocks straight from the stored bytes -- compressed-tensors' int32 words and bf16 group scales, ModelOpt's packed
E2M1 bytes and E4M3 block scales -- and writes five float64 partial sums; `reduce_partials` turns the partials of
all of a layer's matrices into their totals at once (no host synchronisation).

The values are the reference's: the INT4 value `code * scale` (exact in fp32), the NVFP4 value
`e2m1 * (e4m3 * weight_scale_2)` (product first, as `dequantize_nvfp4`), the fp32 difference, then float64 sums.
Only the order of the float64 additions differs (per program, then over programs), so the sums of squares agree
with the reference to about 1e-15 relative, and the count of inexact elements and the largest error exactly
(tests/numerics/test_compare_kernel.py). NaN anywhere (a corrupted scale) makes the largest error NaN, as in the
reference, and is counted as inexact.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .constants import INT4_PER_INT32, NVFP4_BLOCK_SIZE
from .dequant_kernels import int4_block_values, int4_whole_groups, nvfp4_block_values

__all__ = ["PARTIAL_FIELDS", "compare_partials", "int4_whole_groups", "reduce_partials"]

_BLOCKS_PER_PROGRAM = 128
_COMPILE = {"enable_fp_fusion": False, "num_warps": 4}
# Per program: sum of squared errors, sum of squared INT4 values, inexact elements, largest |error|, NaN errors.
PARTIAL_FIELDS = 5


@triton.jit
def _compare_kernel(packed_ptr, group_scale_ptr, weight_ptr, block_scale_ptr, scale_2_ptr, partial_ptr, num_blocks,
                    BLOCKS: tl.constexpr):
    pid = tl.program_id(0)
    block = pid.to(tl.int64) * BLOCKS + tl.arange(0, BLOCKS)
    live = block < num_blocks
    value = int4_block_values(packed_ptr, group_scale_ptr, block, live)
    dequantized = nvfp4_block_values(weight_ptr, block_scale_ptr, scale_2_ptr, block, live)
    error = dequantized - value
    error64 = error.to(tl.float64)
    value64 = value.to(tl.float64)
    base = partial_ptr + pid * 5
    tl.store(base, tl.sum(tl.sum(error64 * error64, axis=1), axis=0))
    tl.store(base + 1, tl.sum(tl.sum(value64 * value64, axis=1), axis=0))
    tl.store(base + 2, tl.sum(tl.sum((error != 0.0).to(tl.float64), axis=1), axis=0))
    tl.store(base + 3, tl.max(tl.max(tl.abs(error64), axis=1), axis=0))
    tl.store(base + 4, tl.sum(tl.sum((error != error).to(tl.float64), axis=1), axis=0))


def compare_partials(
    weight_packed: torch.Tensor, weight_scale: torch.Tensor, nvfp4_weight: torch.Tensor, nvfp4_block_scale: torch.Tensor,
    weight_scale_2: torch.Tensor,
) -> torch.Tensor:
    """float64 `[programs, PARTIAL_FIELDS]` partial sums comparing an INT4 matrix (compressed-tensors `weight_packed`
    int32 `[out, in/8]`, `weight_scale` `[out, in/32]`) with an NVFP4 one (`weight` uint8 `[out, in/2]`, E4M3
    `weight_scale` `[out, in/16]`, fp32 `weight_scale_2`), all on one device. `in` must be a multiple of 32."""
    rows, words = weight_packed.shape
    in_features = words * INT4_PER_INT32
    if not int4_whole_groups(weight_packed, in_features) or tuple(nvfp4_weight.shape) != (rows, in_features // 2):
        raise ValueError(f"cannot compare INT4 {tuple(weight_packed.shape)} words with NVFP4 {tuple(nvfp4_weight.shape)}")
    if tuple(nvfp4_block_scale.shape) != (rows, in_features // NVFP4_BLOCK_SIZE):
        raise ValueError(f"NVFP4 block scales {tuple(nvfp4_block_scale.shape)} do not fit a [{rows}, {in_features}] matrix")
    num_blocks = rows * in_features // NVFP4_BLOCK_SIZE
    programs = max(1, triton.cdiv(num_blocks, _BLOCKS_PER_PROGRAM))
    partial = torch.zeros(programs, PARTIAL_FIELDS, dtype=torch.float64, device=weight_packed.device)
    if num_blocks:
        scale_2 = weight_scale_2.to(device=weight_packed.device, dtype=torch.float32).reshape(1)
        _compare_kernel[(programs,)](
            weight_packed.contiguous(), weight_scale.contiguous(), nvfp4_weight.contiguous(),
            nvfp4_block_scale.contiguous().view(torch.uint8), scale_2, partial, num_blocks,
            BLOCKS=_BLOCKS_PER_PROGRAM, **_COMPILE,
        )
    return partial


def reduce_partials(partials: list[torch.Tensor]) -> torch.Tensor:
    """float64 `[len(partials), 4]` (sum of squared errors, sum of squares, inexact elements, largest |error|) as
    `stats.error_sums` returns per matrix: the error sum as the square of its norm, the largest error NaN when any
    error is NaN. Partials of one shape are reduced together."""
    if not partials:
        return torch.zeros(0, 4, dtype=torch.float64)
    rows: list[torch.Tensor | None] = [None] * len(partials)
    by_shape: dict[tuple[int, ...], list[int]] = {}
    for i, p in enumerate(partials):
        by_shape.setdefault(tuple(p.shape), []).append(i)
    for idx in by_shape.values():
        stacked = torch.stack([partials[i] for i in idx])
        sums = stacked[:, :, :3].sum(dim=1)
        largest = stacked[:, :, 3].amax(dim=1)
        largest = torch.where(stacked[:, :, 4].sum(dim=1) > 0, torch.full_like(largest, float("nan")), largest)
        norm = sums[:, 0].sqrt()
        reduced = torch.stack([norm * norm, sums[:, 1], sums[:, 2], largest], dim=1)
        for k, i in enumerate(idx):
            rows[i] = reduced[k]
    return torch.stack(rows)
