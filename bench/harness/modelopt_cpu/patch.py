"""`modelopt_on_cpu()`: run Model Optimizer 0.47's NVFP4 calibration algorithms, unmodified, on CPU tensors.

What is patched, for the duration of the context only, and why:

1. `modelopt.torch.kernels.quantization.gemm` (the module Model Optimizer's `tensor_quant` calls its Triton
   kernels through): `IS_AVAILABLE` is set True and `static_blockwise_fp4_fake_quant` / `fp4_fake_quant_block`
   are set to the pure-torch twins in `fake_quant.py`. The package only imports its kernels when CUDA is
   present, so on CPU `StaticBlockwiseFP4FakeQuantFunction` raises "requires triton" (every static-block
   recipe: MSE / FP8 sweep, local Hessian, four-over-six).
2. `modelopt.torch.quantization.tensor_quant.dynamic_block_quantize_op` (the callable `_dynamic_block_quantize_
   forward` looks up at each call): wrapped so that NVFP4 (E2M1 values, E4M3 scales) on a CPU tensor goes to
   `fp4_fake_quant_block` with the global amax, exactly where `_dynamic_block_quantize_impl` calls the Triton
   kernel on CUDA; its `assert amax.is_cuda` (before that call) is what stops the max / AWQ-lite recipes and
   every NVFP4 input quantizer on CPU. Anything else goes to the original op.

Nothing else changes: the calibrators, the MSE / Hessian searches (their CPU reference paths), the quantizer
modules and the export code are Model Optimizer's own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from . import fake_quant

# _dynamic_block_quantize_forward's encoding of NVFP4: E2M1 values (4 bits, 2 exponent bits) with E4M3 block
# scales (8 bits, 4 exponent bits)
NVFP4_NUM_BITS, NVFP4_EXPONENT_BITS = 4, 2
E4M3_NUM_BITS, E4M3_EXPONENT_BITS = 8, 4
_MISSING = object()


def _cpu_dynamic_block_quantize(original):
    def op(inputs, block_size, amax, num_bits, exponent_bits, scale_num_bits, scale_exponent_bits):
        nvfp4 = (num_bits, exponent_bits, scale_num_bits, scale_exponent_bits) == (
            NVFP4_NUM_BITS, NVFP4_EXPONENT_BITS, E4M3_NUM_BITS, E4M3_EXPONENT_BITS)
        if not nvfp4 or inputs.is_cuda or amax is None:
            return original(inputs, block_size, amax, num_bits, exponent_bits, scale_num_bits, scale_exponent_bits)
        # as _dynamic_block_quantize_impl: one global amax (the max of a per-channel one)
        global_amax = amax if amax.numel() == 1 else amax.amax()
        return fake_quant.fp4_fake_quant_block(inputs, global_amax, block_size)

    return op


@contextlib.contextmanager
def modelopt_on_cpu() -> Iterator[None]:
    """Within the block, Model Optimizer's NVFP4 fake quantization runs on CPU tensors (see the module docstring);
    every patched attribute is restored on exit."""
    import modelopt.torch.kernels.quantization.gemm as kernels
    import modelopt.torch.quantization.tensor_quant as tensor_quant

    patches = [
        (kernels, "IS_AVAILABLE", True),
        (kernels, "static_blockwise_fp4_fake_quant", fake_quant.static_blockwise_fp4_fake_quant),
        (kernels, "fp4_fake_quant_block", fake_quant.fp4_fake_quant_block),
        (tensor_quant, "dynamic_block_quantize_op", _cpu_dynamic_block_quantize(tensor_quant.dynamic_block_quantize_op)),
    ]
    if torch.cuda.is_available():  # the real kernels are there: nothing to replace
        yield
        return
    saved = [(obj, name, getattr(obj, name, _MISSING)) for obj, name, _ in patches]
    try:
        for obj, name, value in patches:
            setattr(obj, name, value)
        yield
    finally:
        for obj, name, value in saved:
            if value is _MISSING:
                delattr(obj, name)
            else:
                setattr(obj, name, value)
