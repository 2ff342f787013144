"""GPTQ for NVFP4 blocks, batched over experts: columns in order, each column's error pushed onto the rest.

Frantar et al., "GPTQ" (2022), with lazy batch updates, in the form that needs one Cholesky factorisation and no
inverse (Chen et al., "The Geometry of LLM Quantization: GPTQ as Babai's Nearest Plane Algorithm", 2025), adapted to
NVFP4: every 16 input columns share one E4M3 block scale per row, chosen before the block's columns are
quantized, from the block's current (error-updated) weights. Per expert e with input Hessian H (dampened):

    H = R R^T, R upper               (the Cholesky factor of the reversed H, flipped back; `hessian_factor`)
    P = R / diag(R) column-wise      (P_jk = R_jk / R_kk: what a unit error in column j moves column k by)
    per 16-column block B:
        v = w_B - (w_B - t_B) P_BB^-1            (t: the block's weights with every earlier block's error pushed)
        bits = the candidate scale with the least sum_j (v_j - q_j)**2 / U_jj**2,  U_BB = R_BB^-1
        for each column j of B: q = e2m1(v_j / d) * d;  v_k -= (v_j - q) / U_jj * U_jk (k > j in B)
        e_B = w_B - q_B (against the original weights), pushed onto every later column: t_k += e_B P_Bk

Why this is GPTQ: GPTQ's form uses U, the upper Cholesky factor of H^-1, and pushes `(w'_j - q_j) / U_jj * U_jk`.
U = R^-1, and its updates sum to `w'_k = w_k + sum_{j<k} (w_j - q_j) P_jk`: the same quantized values in exact
arithmetic, with errors taken against the original weights and one Cholesky factorisation instead of a
factorisation and a triangular inverse (the inverse was more than half the factor's arithmetic at K2.6's 7,168
columns). Only a block's first weights differ between the two forms before its columns are quantized (t is not
GPTQ's w'); NVFP4 picks the block's scale there, so v, GPTQ's w' of the block, is recovered from t with the block's
own 16 x 16 triangle, and the 16 column steps run in GPTQ's form on U_BB = R_BB^-1. tests/numerics/test_gptq.py
keeps GPTQ's inverse form, column by column, as the oracle.

All experts of a batch share the shapes, so every step is one batched op over [experts, rows, columns]. The
target W is the exact INT4 matrix (float64 here), never BF16. Rows are independent (an expert's gate and up are
stacked and share H and the factor). Quantization itself is NVFP4's: `x = fp32(w / d)`, the code is
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
    "hessian_factor",
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
# On CUDA, a block's scale choice and its 16 column steps run as one Triton kernel (numerics/gptq_block_kernel.py:
# the same bits) instead of ~40 small torch kernels, which left the loop launch-bound; False keeps the torch path.
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
    ok = torch.zeros(h.shape[0], dtype=torch.bool, device=h.device)
    for attempt in range(retries + 1):
        todo = (~ok).nonzero().reshape(-1)
        if not todo.numel():
            return
        extra = damping * growth**attempt * mean[todo]
        # One copy of the experts to factorise, the damping added on its diagonal in place (the same values as
        # `h + extra * I`, without an [E, n, n] temporary for `extra * I`): at K2.6's 7,168 channels each such
        # copy is 411 MB an expert, and the solve batch is planned from how many are alive
        # (stage_kit/expert_solve_plan.py SOLVE_MATRICES).
        dampened = h.clone() if todo.numel() == h.shape[0] else h[todo]
        dampened.diagonal(dim1=-2, dim2=-1).add_(extra.view(-1, 1))
        lower, info = torch.linalg.cholesky_ex(dampened)
        del dampened
        good = info == 0
        if bool(good.all()):
            ok[todo] = True
            yield todo, lower
        elif bool(good.any()):
            ok[todo[good]] = True
            yield todo[good], lower[good]
        del lower


def hessian_factor(
    hessian: torch.Tensor, damping: float = HESSIAN_DAMPING, *, retries: int = DAMPING_RETRIES,
    growth: float = DAMPING_GROWTH,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(R, ok): the upper triangular R `[E, in, in]` with `R R^T` the dampened Hessian, and a bool `[E]` that is
    False where no damping up to `damping * growth**retries` made H positive definite (R is then the identity).

    With J the reversal permutation and J H J = L L^T, H = (J L J)(J L^T J) and J L J is upper: one batched
    factorisation, no inverse. Its trailing blocks factor H's trailing blocks, which is what GPTQ's order needs (the
    columns after j are the ones still free). Channels with zero energy get H_jj = 1 first (GPTQ's dead-channel
    rule: nothing propagates through them).
    """
    h, mean = live_channel_hessian(hessian)
    h = h.flip(-2, -1)  # a copy (torch's flip copies); the unflipped one is freed here
    experts = h.shape[0]
    ok = torch.zeros(experts, dtype=torch.bool, device=h.device)
    factor = None
    for done, lower in dampened_cholesky(h, mean, damping, retries=retries, growth=growth):
        ok[done] = True
        if done.numel() == experts:  # all at the first attempt (the usual case): no [E, n, n] of zeros beside it
            factor = lower.flip(-2, -1)
        else:
            factor = torch.zeros_like(h) if factor is None else factor
            factor[done] = lower.flip(-2, -1)
    if factor is None:
        factor = torch.zeros_like(h)
    factor[~ok] = torch.eye(h.shape[-1], dtype=h.dtype, device=h.device)
    return factor, ok


def _propagation(factor: torch.Tensor) -> torch.Tensor:
    """P: `factor` R divided column-wise by its diagonal, in place (`P_jk = R_jk / R_kk`, unit diagonal)."""
    return factor.div_(factor.diagonal(dim1=-2, dim2=-1).clone().unsqueeze(-2))


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


def _diagonal_blocks(factor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(U_BB, P_BB^-1), each `[E, in/16, 16, 16]`: per 16-column block, the inverse of R's diagonal triangle (GPTQ's
    U restricted to the block) and the inverse of P's (`diag(R_BB) U_BB`: the rows of U_BB scaled by R_jj)."""
    experts, n, _ = factor.shape
    count = n // NVFP4_BLOCK_SIZE
    tiles = factor.view(experts, count, NVFP4_BLOCK_SIZE, count, NVFP4_BLOCK_SIZE)
    triangles = torch.diagonal(tiles, dim1=1, dim2=3).permute(0, 3, 1, 2).contiguous()  # [E, blocks, 16, 16]
    eye = torch.eye(NVFP4_BLOCK_SIZE, dtype=factor.dtype, device=factor.device)
    inverse = torch.linalg.solve_triangular(triangles, eye.expand_as(triangles), upper=True).contiguous()
    return inverse, (triangles.diagonal(dim1=-2, dim2=-1).unsqueeze(-1) * inverse).contiguous()


def _block_reference(
    batch: torch.Tensor, weight: torch.Tensor, block_start: int, column: int, inverse: torch.Tensor,
    restore: torch.Tensor, search_bits: torch.Tensor, weight_scale_2: torch.Tensor, window: tuple[int, int],
    codes: torch.Tensor, bits: torch.Tensor, errors: torch.Tensor,
) -> None:
    """One 16-column block (torch; the CPU path and the fused kernel's reference): GPTQ's weights of the block from
    the pushed ones, each row's block scale chosen on them, then the column steps in GPTQ's form; the errors
    against the original weights go to `errors` for the pushes onto later columns (module docstring).

    :param batch: float64 `[E, R, W]`, the lazy batch of pushed weights t (the block is its columns
        `block_start:+16`, input columns `column:+16`); :param weight: float64 `[E, R, in]`, the originals.
    :param inverse: U_BB, :param restore: P_BB^-1, both `[E, in/16, 16, 16]` (`_diagonal_blocks`).
    :param codes: uint8 `[E, R, in]`, :param bits: uint8 `[E, R, in/16]`, :param errors: float64 `[E, R, W]`:
        written at the block's columns.
    """
    block = column // NVFP4_BLOCK_SIZE
    u, m = inverse[:, block], restore[:, block]  # [E, 16, 16]
    original = weight[..., column : column + NVFP4_BLOCK_SIZE]
    pushed = original - batch[..., block_start : block_start + NVFP4_BLOCK_SIZE]
    # (w - t) P_BB^-1, summed over j in order from zero (the kernel's order)
    undo = torch.zeros_like(pushed)
    for j in range(NVFP4_BLOCK_SIZE):
        undo = undo + pushed[..., j : j + 1] * m[:, j].unsqueeze(1)
    current = original - undo
    pivots = u.diagonal(dim1=-2, dim2=-1)  # [E, 16]
    block_bits = _choose_block_scales(current, 1.0 / (pivots * pivots), search_bits[..., block], weight_scale_2,
                                      window)
    bits[..., block] = block_bits
    divisor = e4m3_bits_to_fp32(block_bits) * weight_scale_2.view(-1, 1)  # [E, R] fp32, as dequantize forms it
    for j in range(NVFP4_BLOCK_SIZE):
        code, quantized = _quantized(current[..., j], divisor)
        codes[..., column + j] = code
        step = (current[..., j] - quantized) / pivots[:, j].view(-1, 1)
        current[..., j + 1 :] -= step.unsqueeze(-1) * u[:, j, j + 1 :].unsqueeze(1)
        errors[..., block_start + j] = original[..., j] - quantized


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
        whose Hessian could be factorised (the others are quantized with R = I: no error propagation).
    """
    if block_columns % NVFP4_BLOCK_SIZE:
        raise ValueError(f"block_columns {block_columns} is not a multiple of {NVFP4_BLOCK_SIZE}")
    if block_order:
        return _block_ordered(weight, hessian, weight_scale_2, search_bits, block_columns=block_columns,
                              damping=damping, retries=retries, growth=growth, scale_window=scale_window, fused=fused)
    experts, rows, in_features = weight.shape
    factor, ok = hessian_factor(hessian, damping, retries=retries, growth=growth)
    factor = factor.to(weight.dtype)
    inverse, restore = _diagonal_blocks(factor)
    propagate = _propagation(factor)
    work = weight.clone()
    codes = torch.empty((experts, rows, in_features), dtype=torch.uint8, device=weight.device)
    bits = torch.empty((experts, rows, in_features // NVFP4_BLOCK_SIZE), dtype=torch.uint8, device=weight.device)
    kernel = _fused_block_kernel(weight.device, USE_FUSED_GPTQ if fused is None else fused)
    block = kernel.gptq_block if kernel is not None else _block_reference
    for start in range(0, in_features, block_columns):
        stop = min(in_features, start + block_columns)
        batch = work[..., start:stop].clone()
        errors = torch.zeros_like(batch)
        # Within a batch, a 16-column block's errors reach the batch's later blocks in one bmm too (the same lazy
        # update one level down), so a column's own update only touches its block.
        for block_start in range(0, stop - start, NVFP4_BLOCK_SIZE):
            block_stop = block_start + NVFP4_BLOCK_SIZE
            column = start + block_start
            block(batch, weight, block_start, column, inverse, restore, search_bits, weight_scale_2, scale_window,
                  codes, bits, errors)
            if block_stop < stop - start:
                block_errors = errors[..., block_start:block_stop]
                batch[..., block_stop:] += torch.bmm(block_errors,
                                                     propagate[:, column : start + block_stop, start + block_stop : stop])
        if stop < in_features:
            work[..., stop:] += torch.bmm(errors, propagate[:, start:stop, stop:])
    return codes, bits, ok
