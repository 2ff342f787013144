"""GPTQ for NVFP4 blocks, batched over experts: columns in order, each column's error pushed onto the rest.

Frantar et al., "GPTQ" (2022), with the Cholesky form of the inverse Hessian and lazy batch updates, adapted to
NVFP4: every 16 input columns share one E4M3 block scale per row, chosen before the block's columns are
quantized, from the block's current (error-updated) weights. Per expert e with input Hessian H (dampened):

    U = chol(H^-1), upper                          (one batched Cholesky and triangular solve, see below)
    for each 16-column block: bits = the candidate scale with the least sum_j (w_j - q_j)**2 / U_jj**2
        (the OBS cost of quantizing column j alone: what GPTQ's column step minimises; U_jj**2 = [H_F^-1]_jj)
        for each column j: q = e2m1(w / d) * d;  err = (w - q) / U_jj;  W[:, j:] -= err U[j, j:]
    columns are processed in batches of `BLOCK_COLUMNS`; a batch's errors reach later columns in one bmm.

All experts of a batch share the shapes, so every step is one batched op over [experts, rows, columns]. The
target W is the exact INT4 matrix (float64 here), never BF16. Rows are independent (an expert's gate and up are
stacked and share H and the Cholesky factor). Quantization itself is NVFP4's: `x = fp32(w / d)`, the code is
`encode_e2m1(x)`, and the value is `e2m1 * d` formed in fp32 as `dequantize_nvfp4` forms it.

Determinism: the matrix products and the Cholesky factorisations order their sums as the BLAS/LAPACK (CPU) or
cuBLAS/cuSOLVER (CUDA) kernels do, so CPU and CUDA results can differ in the last bits of float64 and, rarely, a
code whose value sits on a rounding boundary flips. The CPU is the reference (docs/numerics.md).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from ...constants import E2M1_MAX, NVFP4_BLOCK_SIZE
from ...e2m1 import decode_e2m1, encode_e2m1, round_e2m1_magnitude
from ...e4m3 import E4M3_MAX_BITS, E4M3_MIN_POSITIVE_BITS, e4m3_bits, e4m3_bits_to_fp32, round_block_scale_to_e4m3
from ...triton_support import triton_module
from .output_error import fixed_order_sum

__all__ = [
    "BLOCK_COLUMNS",
    "DAMPING_GROWTH",
    "DAMPING_RETRIES",
    "HESSIAN_DAMPING",
    "SCALE_WINDOW",
    "block_energy_order",
    "dampened_cholesky",
    "gptq_quantize",
    "inverse_hessian_factor",
    "live_channel_hessian",
]

# H + damping * mean(diag H) * I (GPTQ's `percdamp`): keeps H invertible where calibration saw too few directions.
HESSIAN_DAMPING = 0.01
# Retries of a failed Cholesky factorisation, the damping multiplied by 10 each time (not seen on real-shaped data).
DAMPING_RETRIES = 4
DAMPING_GROWTH = 10.0
# Columns per lazy batch (a multiple of the NVFP4 block): their errors reach the later columns in one bmm.
BLOCK_COLUMNS = 128
# Scale candidates for an updated block: E4M3 bit offsets around its amax/6 scale (Model Optimizer's target), the
# search's own choice tried first. Unweighted optima lie within amax/7.2..amax/3.5 (offsets -2..+6, docs/numerics.md
# "Why these candidates"); the window is one wider on each side, as weighting moves the optimum.
SCALE_WINDOW = (-3, 7)
# On CUDA, a block's 16 column steps run as one Triton kernel (numerics/gptq_block_kernel.py: the same bits) instead
# of ~25 elementwise kernels per column, which left the loop launch-bound; False keeps the torch loop everywhere.
USE_FUSED_GPTQ = True


def live_channel_hessian(hessian: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(H with H_jj = 1 where it was 0, the mean of that diagonal `[E]`): GPTQ's dead-channel rule, and the
    scale of its damping (`damping * mean * I`, grown by DAMPING_GROWTH per failed factorisation)."""
    h = hessian.clone()
    diagonal = h.diagonal(dim1=-2, dim2=-1)
    diagonal.masked_fill_(diagonal == 0, 1.0)
    return h, fixed_order_sum(diagonal) / h.shape[-1]


def dampened_cholesky(
    h: torch.Tensor, mean: torch.Tensor, damping: float, *, retries: int = DAMPING_RETRIES,
    growth: float = DAMPING_GROWTH,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Lower Cholesky factors of `h + damping * mean * I` `[E, n, n]`, the damping grown by `growth` for the
    experts whose factorisation failed, up to `retries` times: yields `(experts, lower)` per attempt that
    factorised some (indices `[k]`, factors `[k, n, n]`); experts never yielded stayed indefinite."""
    eye = torch.eye(h.shape[-1], dtype=h.dtype, device=h.device)
    ok = torch.zeros(h.shape[0], dtype=torch.bool, device=h.device)
    for attempt in range(retries + 1):
        todo = (~ok).nonzero().reshape(-1)
        if not todo.numel():
            return
        extra = damping * growth**attempt * mean[todo]
        lower, info = torch.linalg.cholesky_ex(h[todo] + extra.view(-1, 1, 1) * eye)
        good = info == 0
        if bool(good.any()):
            ok[todo[good]] = True
            yield todo[good], lower[good]


def inverse_hessian_factor(
    hessian: torch.Tensor, damping: float = HESSIAN_DAMPING, *, retries: int = DAMPING_RETRIES,
    growth: float = DAMPING_GROWTH,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(U, ok): the upper Cholesky factor of the dampened inverse Hessian `[E, in, in]`, and a bool `[E]` that is
    False where no damping up to `damping * growth**retries` made H positive definite (U is then the identity).

    With J the reversal permutation and J H J = L L^T, H^-1 = (J L^-T J)(J L^-1 J), a product of a lower
    triangular matrix and its transpose, so U = J L^-1 J (Cholesky factors are unique): one factorisation and one
    triangular solve, no explicit inverse. Channels with zero energy get H_jj = 1 first (GPTQ's dead-channel
    rule: nothing propagates through them).
    """
    h, mean = live_channel_hessian(hessian)
    eye = torch.eye(h.shape[-1], dtype=h.dtype, device=h.device)
    factor = torch.zeros_like(h)
    ok = torch.zeros(h.shape[0], dtype=torch.bool, device=h.device)
    for experts, lower in dampened_cholesky(h.flip(-2, -1), mean, damping, retries=retries, growth=growth):
        inverse = torch.linalg.solve_triangular(lower, eye.expand(experts.numel(), -1, -1), upper=False)
        factor[experts] = inverse.flip(-2, -1)
        ok[experts] = True
    factor[~ok] = eye
    return factor, ok


def _block_candidates(
    weight: torch.Tensor, search_bits: torch.Tensor, weight_scale_2: torch.Tensor, window: tuple[int, int]
) -> torch.Tensor:
    """uint8 `[C, E, R]`: the search's bits, then the window around each updated block's amax/6 scale."""
    amax = weight.abs().amax(dim=-1).to(torch.float32)  # [E, R]
    target = amax / (E2M1_MAX * weight_scale_2.view(-1, 1))
    centre = e4m3_bits(round_block_scale_to_e4m3(target)).to(torch.int16)
    around = [(centre + o).clamp(E4M3_MIN_POSITIVE_BITS, E4M3_MAX_BITS) for o in range(window[0], window[1] + 1)]
    return torch.stack([search_bits.to(torch.int16)] + around).to(torch.uint8)


def _quantized(weight: torch.Tensor, divisor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(E2M1 codes uint8, dequantized float64) of float64 `weight` under fp32 block scales `divisor` (broadcast)."""
    x = (weight / divisor.double()).to(torch.float32)
    codes = encode_e2m1(x)
    return codes, (decode_e2m1(codes) * divisor).double()


def _choose_block_scales(
    weight: torch.Tensor, cost: torch.Tensor, search_bits: torch.Tensor, weight_scale_2: torch.Tensor,
    window: tuple[int, int] = SCALE_WINDOW,
) -> torch.Tensor:
    """uint8 `[E, R]`: per row of a 16-column block `weight` `[E, R, 16]`, the candidate with the least
    `sum_j cost_j * (w_j - q_j)**2` (`cost` `[E, 16]`); the search's bits on a tie, else the first minimum."""
    bits = _block_candidates(weight, search_bits, weight_scale_2, window)  # [C, E, R]
    divisor = (e4m3_bits_to_fp32(bits) * weight_scale_2.view(1, -1, 1)).unsqueeze(-1)  # [C, E, R, 1] fp32
    # E2M1 rounding is sign-symmetric, so |w - q| = | |w| - e2m1(|w| / d) * d |.
    magnitude = weight.abs().unsqueeze(0)
    rounded = round_e2m1_magnitude((magnitude / divisor.double()).to(torch.float32))
    error = magnitude - (rounded * divisor).double()
    errors = fixed_order_sum(error * error * cost.view(1, cost.shape[0], 1, -1))  # [C, E, R]
    errors = torch.where(torch.isnan(errors), torch.full_like(errors, float("inf")), errors)
    first = torch.argmax((errors == errors.amin(dim=0)).to(torch.uint8), dim=0)
    return torch.gather(bits, 0, first.unsqueeze(0)).squeeze(0)


def _block_columns_reference(
    batch: torch.Tensor, block_start: int, divisor: torch.Tensor, upper: torch.Tensor, diagonal: torch.Tensor,
    column: int, codes: torch.Tensor, errors: torch.Tensor,
) -> None:
    """One 16-column block's column steps (torch; the CPU path and the fused kernel's reference): quantize column j
    with the block's scales, record its error `(w - q) / U_jj`, push it onto the block's later columns."""
    block_stop = block_start + NVFP4_BLOCK_SIZE
    offset = column - block_start  # batch column j is input column offset + j
    for j in range(block_start, block_stop):
        code, quantized = _quantized(batch[..., j], divisor)
        codes[..., offset + j] = code
        error = (batch[..., j] - quantized) / diagonal[:, offset + j].view(-1, 1)
        batch[..., j:block_stop] -= error.unsqueeze(-1) * upper[:, offset + j, offset + j : offset + block_stop].unsqueeze(1)
        errors[..., j] = error


def _fused_block_kernel(device: torch.device, fused: bool):
    """numerics/gptq_block_kernel.py on CUDA where Triton is installed and `fused`, else None."""
    if device.type != "cuda" or not fused:
        return None
    return triton_module("gptq_block_kernel")


def block_energy_order(hessian: torch.Tensor) -> torch.Tensor:
    """int64 `[E, in/16]`: per expert, its 16-column NVFP4 blocks by decreasing input energy (the sum of diag H
    over the block's columns; ties in block order). GPTQ's act-order at the granularity that keeps every NVFP4
    scale group's 16 columns together."""
    experts, in_features = hessian.shape[0], hessian.shape[-1]
    energy = hessian.diagonal(dim1=-2, dim2=-1).reshape(experts, in_features // NVFP4_BLOCK_SIZE, NVFP4_BLOCK_SIZE)
    return torch.sort(energy.sum(dim=-1), dim=-1, descending=True, stable=True).indices


def _block_ordered(
    weight: torch.Tensor, hessian: torch.Tensor, weight_scale_2: torch.Tensor, search_bits: torch.Tensor,
    **keywords,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`gptq_quantize` with each expert's blocks in `block_energy_order` (columns permuted block-wise, the codes
    and block scales put back in input order afterwards)."""
    experts, rows, in_features = weight.shape
    blocks = block_energy_order(hessian)  # [E, B]
    columns = (blocks.unsqueeze(-1) * NVFP4_BLOCK_SIZE
               + torch.arange(NVFP4_BLOCK_SIZE, device=blocks.device)).reshape(experts, in_features)
    by_row = columns.unsqueeze(1).expand(-1, rows, -1)
    h = torch.gather(hessian, 1, columns.unsqueeze(-1).expand(-1, -1, in_features))
    h = torch.gather(h, 2, columns.unsqueeze(1).expand(-1, in_features, -1))
    blocks_by_row = blocks.unsqueeze(1).expand(-1, rows, -1)
    codes, bits, ok = gptq_quantize(torch.gather(weight, 2, by_row), h, weight_scale_2,
                                    torch.gather(search_bits, 2, blocks_by_row), block_order=False, **keywords)
    return (torch.empty_like(codes).scatter_(2, by_row, codes), torch.empty_like(bits).scatter_(2, blocks_by_row, bits),
            ok)


def gptq_quantize(
    weight: torch.Tensor, hessian: torch.Tensor, weight_scale_2: torch.Tensor, search_bits: torch.Tensor,
    *, block_columns: int = BLOCK_COLUMNS, damping: float = HESSIAN_DAMPING, retries: int = DAMPING_RETRIES,
    growth: float = DAMPING_GROWTH, scale_window: tuple[int, int] = SCALE_WINDOW, fused: bool | None = None,
    block_order: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GPTQ over a batch of experts (module docstring). The keywords are `catalog/gptq.py`'s `GptqOptions`
    (their defaults are this module's constants; `fused=None` means USE_FUSED_GPTQ). `block_order`: quantize each
    expert's 16-column blocks by decreasing input energy instead of in input order (`block_energy_order`; the
    NVFP4 scale groups are unchanged, only the order in which errors are pushed onto the others).

    :param weight: float64 `[E, R, in]`, the exact INT4 values (rows of the matrices sharing this input).
    :param hessian: float64 `[E, in, in]`, `X^T X / n` per expert (undampened).
    :param weight_scale_2: float32 `[E]`, the tensor scale each expert keeps (the search's).
    :param search_bits: uint8 `[E, R, in/16]`, the search's block scales (tried first for every block).
    :return: E2M1 codes uint8 `[E, R, in]`, block-scale bits uint8 `[E, R, in/16]`, and the bool `[E]` of experts
        whose Hessian could be factorised (the others are quantized with U = I: no error propagation).
    """
    if block_columns % NVFP4_BLOCK_SIZE:
        raise ValueError(f"block_columns {block_columns} is not a multiple of {NVFP4_BLOCK_SIZE}")
    if block_order:
        return _block_ordered(weight, hessian, weight_scale_2, search_bits, block_columns=block_columns,
                              damping=damping, retries=retries, growth=growth, scale_window=scale_window, fused=fused)
    experts, rows, in_features = weight.shape
    upper, ok = inverse_hessian_factor(hessian, damping, retries=retries, growth=growth)
    upper = upper.to(weight.dtype)
    work = weight.clone()
    codes = torch.empty((experts, rows, in_features), dtype=torch.uint8, device=weight.device)
    bits = torch.empty((experts, rows, in_features // NVFP4_BLOCK_SIZE), dtype=torch.uint8, device=weight.device)
    diagonal = upper.diagonal(dim1=-2, dim2=-1)  # [E, in]
    kernel = _fused_block_kernel(weight.device, USE_FUSED_GPTQ if fused is None else fused)
    scale_2 = weight_scale_2.view(-1, 1)
    for start in range(0, in_features, block_columns):
        stop = min(in_features, start + block_columns)
        batch = work[..., start:stop].clone()
        errors = torch.zeros_like(batch)
        # Within a batch, a 16-column block's errors reach the batch's later blocks in one bmm too (the same lazy
        # update one level down), so a column's own update only touches its block.
        for block_start in range(0, stop - start, NVFP4_BLOCK_SIZE):
            block_stop = block_start + NVFP4_BLOCK_SIZE
            column = start + block_start
            pivots = diagonal[:, column : column + NVFP4_BLOCK_SIZE]
            block_bits = _choose_block_scales(
                batch[..., block_start:block_stop], 1.0 / (pivots * pivots),
                search_bits[..., column // NVFP4_BLOCK_SIZE], weight_scale_2, scale_window,
            )
            bits[..., column // NVFP4_BLOCK_SIZE] = block_bits
            divisor = e4m3_bits_to_fp32(block_bits) * scale_2  # [E, R] fp32, as dequantize forms it
            if kernel is not None:
                kernel.gptq_block_columns(batch, block_start, divisor, upper, column, codes, errors)
            else:
                _block_columns_reference(batch, block_start, divisor, upper, diagonal, column, codes, errors)
            if block_stop < stop - start:
                block_errors = errors[..., block_start:block_stop]
                batch[..., block_stop:] -= torch.bmm(block_errors, upper[:, column : start + block_stop, start + block_stop : stop])
        if stop < in_features:
            work[..., stop:] -= torch.bmm(errors, upper[:, start:stop, stop:])
    return codes, bits, ok
