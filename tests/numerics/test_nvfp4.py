"""quantize_nvfp4 is bit-identical to Model Optimizer's NVFP4QTensor.quantize; dequantize agrees too."""

from __future__ import annotations

import pytest
import torch
from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor

from kimi_nvfp4.numerics.constants import E4M3_MIN_BLOCK_SCALE
from kimi_nvfp4.numerics.nvfp4 import (
    NVFP4Tensor,
    dequantize_nvfp4,
    quantize_nvfp4,
    tensor_scale_from_amax,
)


def _modelopt(w: torch.Tensor, weight_scale_2: torch.Tensor | None = None):
    q, scale, scale_2 = NVFP4QTensor.quantize(w.clone(), 16, weights_scaling_factor_2=weight_scale_2)
    return q, scale, scale_2


def _assert_identical(w: torch.Tensor, weight_scale_2: torch.Tensor | None = None) -> NVFP4Tensor:
    ours = quantize_nvfp4(w, weight_scale_2=weight_scale_2)
    q, scale, scale_2 = _modelopt(w, weight_scale_2)
    assert torch.equal(ours.weight, q._quantized_data)
    assert torch.equal(ours.weight_scale.view(torch.uint8), scale.view(torch.uint8))
    assert torch.equal(ours.weight_scale_2.view(torch.int32), scale_2.float().reshape(()).view(torch.int32))
    deq = q.dequantize(dtype=torch.float32, scale=scale, double_scale=scale_2, block_sizes={-1: 16})
    assert torch.equal(dequantize_nvfp4(ours), deq)
    return ours


def _int4_values(rows: int, cols: int, seed: int, scale_range: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(-8, 8, (rows, cols), generator=gen).float()
    scale = torch.exp(torch.randn(rows, cols // 32, generator=gen) * scale_range).to(torch.bfloat16).float()
    return codes * scale.repeat_interleave(32, dim=1)


@pytest.mark.parametrize("seed", range(3))
def test_random_gaussian(seed):
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(seed))
    _assert_identical(w)


@pytest.mark.parametrize("seed", range(3))
def test_exact_int4_values(seed):
    _assert_identical(_int4_values(48, 512, seed))


def test_zero_blocks_get_scale_one():
    w = _int4_values(8, 128, 5)
    w[:, :16] = 0
    w[3] = 0
    ours = _assert_identical(w)
    assert (ours.weight_scale[:, 0].float() == 1.0).all()


def test_huge_dynamic_range_hits_min_block_scale():
    # Blocks ~1e-8 of the tensor amax: their scale underflows to the 2**-9 clamp.
    w = _int4_values(16, 128, 6)
    w[:8] *= 1e-8
    ours = _assert_identical(w)
    assert (ours.weight_scale.float() == E4M3_MIN_BLOCK_SCALE).any()


def test_denormal_range_block_scales():
    # Block scales between 2**-9 and 2**-6 are e4m3 subnormals.
    w = _int4_values(16, 256, 7)
    w[:12] *= torch.logspace(-3, -1.5, 12).unsqueeze(-1)
    ours = _assert_identical(w)
    scales = ours.weight_scale.float()
    assert ((scales < 2**-6) & (scales > E4M3_MIN_BLOCK_SCALE)).any()


def test_tiny_and_huge_magnitudes():
    _assert_identical(torch.randn(8, 64, generator=torch.Generator().manual_seed(8)) * 1e-30)
    _assert_identical(torch.randn(8, 64, generator=torch.Generator().manual_seed(9)) * 1e30)


def test_shared_weight_scale_2_for_gate_up_pair():
    gate = _int4_values(32, 256, 10)
    up = _int4_values(32, 256, 11) * 4
    shared = tensor_scale_from_amax(torch.maximum(gate.abs().amax(), up.abs().amax()))
    g = _assert_identical(gate, shared)
    u = _assert_identical(up, shared)
    assert torch.equal(g.weight_scale_2, u.weight_scale_2)


def test_all_zero_tensor_is_finite_and_zero():
    t = quantize_nvfp4(torch.zeros(4, 32))
    assert torch.isfinite(t.weight_scale.float()).all() and (t.weight == 0).all()
    assert (dequantize_nvfp4(t) == 0).all()


def test_rejects_bad_shapes():
    with pytest.raises(ValueError):
        quantize_nvfp4(torch.zeros(4, 24))
    with pytest.raises(ValueError):
        quantize_nvfp4(torch.zeros(4, 32, dtype=torch.bfloat16))
    with pytest.raises(ValueError):
        NVFP4Tensor(torch.zeros(4, 16, dtype=torch.uint8), torch.zeros(4, 3).to(torch.float8_e4m3fn), torch.tensor(1.0))


def test_tensor_scale_is_the_true_quotient_not_a_reciprocal_product():
    """weight_scale_2 = amax / 2688 correctly rounded, as Model Optimizer computes it on the CPU.

    Multiplying by float32(1/2688) (what CUDA does for a CPU-scalar divisor) differs in the last bit for
    some amax; divide_exactly keeps the IEEE quotient so CPU and CUDA agree.
    """
    import numpy as np

    from kimi_nvfp4.numerics.constants import NVFP4_TENSOR_SCALE_DENOMINATOR
    from kimi_nvfp4.numerics.nvfp4 import divide_exactly, tensor_scale_from_amax

    amax = np.random.default_rng(0).uniform(0.01, 10.0, 20_000).astype(np.float32)
    true_quotient = amax / np.float32(NVFP4_TENSOR_SCALE_DENOMINATOR)
    reciprocal_product = amax * (np.float32(1.0) / np.float32(NVFP4_TENSOR_SCALE_DENOMINATOR))
    assert (true_quotient != reciprocal_product).any()  # the two roundings really differ
    ours = divide_exactly(torch.from_numpy(amax), NVFP4_TENSOR_SCALE_DENOMINATOR).numpy()
    assert np.array_equal(ours, true_quotient)
    differing = int(np.flatnonzero(true_quotient != reciprocal_product)[0])
    assert tensor_scale_from_amax(torch.tensor(amax[differing])).item() == true_quotient[differing]
