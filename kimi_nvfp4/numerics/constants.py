"""Named constants of the formats involved. Never inline their products."""

from __future__ import annotations

# FP4 E2M1: largest magnitude of {0, 0.5, 1, 1.5, 2, 3, 4, 6}.
E2M1_MAX = 6.0
# FP8 E4M3 (float8_e4m3fn): largest finite value, and the smallest block scale ModelOpt keeps
# (its `_cast_per_block_scale_to_fp8` clamps to [2**-9, 448] to avoid underflow to 0).
E4M3_MAX = 448.0
E4M3_MIN_BLOCK_SCALE = 2.0**-9
# ModelOpt: weight_scale_2 = amax / (E2M1_MAX * E4M3_MAX); input_scale likewise from activation amax.
NVFP4_TENSOR_SCALE_DENOMINATOR = E2M1_MAX * E4M3_MAX
# NVFP4 block: one E4M3 scale per 16 consecutive input elements.
NVFP4_BLOCK_SIZE = 16
# Kimi K2.x routed experts: compressed-tensors pack-quantized, symmetric int4, group 32.
INT4_GROUP_SIZE = 32
INT4_BITS = 4
INT4_MIN = -8
INT4_MAX = 7
INT4_OFFSET = 8  # nibbles store q + 8 (offset binary)
INT4_PER_INT32 = 32 // INT4_BITS
