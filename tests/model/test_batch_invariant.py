"""The batch-invariant primitives (kimi_nvfp4/model/batch_invariant.py): a row's result does not depend on the batch
it is computed in -- its size, the row's position, the number of threads -- and equals the plain product."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kimi_nvfp4.model import batch_invariant
from kimi_nvfp4.model.batch_invariant import batched_rows, linear_rows, pointwise_rows

BATCHES = (1, 2, 5, 17, 63, 64, 65, 130, 700)


def _row_zero_in_every_batch(fn, x: torch.Tensor) -> list[torch.Tensor]:
    """Row 0 of `x` computed inside batches of BATCHES sizes, at the first, middle and last position."""
    out = []
    for rows in BATCHES:
        for pos in sorted({0, rows // 2, rows - 1}):
            order = list(range(1, rows))
            order.insert(pos, 0)
            out.append(fn(x[order])[pos])
    return out


def _threads(n: int):
    class _Scope:
        def __enter__(self):
            self.before = torch.get_num_threads()
            torch.set_num_threads(n)

        def __exit__(self, *exc):
            torch.set_num_threads(self.before)

    return _Scope()


# (reduction, outputs): the demo's shapes, and reductions long enough for MKL to split them over threads (>= 1024)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("k,n", [(256, 96), (96, 256), (256, 16), (2048, 128), (1536, 64)])
def test_linear_rows_is_invariant_to_batch_position_and_threads(k, n, dtype, stage_device):
    gen = torch.Generator().manual_seed(k * n)
    x = torch.randn(700, k, generator=gen).to(device=stage_device, dtype=dtype)
    w = torch.randn(n, k, generator=gen).to(device=stage_device, dtype=dtype)
    seen = []
    for threads in (1, 2):
        with _threads(threads):
            seen += _row_zero_in_every_batch(lambda rows: linear_rows(rows, w), x)
    assert all(torch.equal(seen[0], s) for s in seen[1:])
    # and it is the product (fp32 accumulation), within the rounding of the compute dtype
    ref = x[:1].double() @ w.double().t()
    torch.testing.assert_close(seen[0].double()[None], ref, rtol=1e-2 if dtype == torch.bfloat16 else 1e-5,
                               atol=1e-2 if dtype == torch.bfloat16 else 1e-4)


def test_linear_rows_writes_into_views_and_handles_no_rows():
    x, w = torch.randn(70, 32), torch.randn(8, 32)
    out = torch.full((100, 8), float("nan"))
    linear_rows(x, w, out=out[10:80])
    torch.testing.assert_close(out[10:80], F.linear(x, w))
    assert out[:10].isnan().all() and out[80:].isnan().all()
    assert linear_rows(x[:0], w).shape == (0, 8)
    with pytest.raises(ValueError, match="do not multiply"):
        linear_rows(x, torch.randn(8, 31))


@pytest.mark.parametrize("fn", [torch.sigmoid, F.silu, lambda g: F.silu(g) * g], ids=["sigmoid", "silu", "swiglu"])
@pytest.mark.parametrize("cols", [16, 24, 96, 385])
def test_pointwise_rows_is_invariant_where_plain_vectorized_loops_are_not(fn, cols):
    x = torch.randn(700, cols, generator=torch.Generator().manual_seed(cols)) * 4
    seen = []
    for threads in (1, 2):
        with _threads(threads):
            seen += _row_zero_in_every_batch(lambda rows: pointwise_rows(fn, rows), x)
    assert all(torch.equal(seen[0], s) for s in seen[1:])
    torch.testing.assert_close(pointwise_rows(fn, x), fn(x), rtol=2e-7, atol=1e-7)


def test_batched_rows_cuts_long_reductions_the_same_for_any_thread_count():
    gen = torch.Generator().manual_seed(3)
    a, b = torch.randn(4, 40, 2000, generator=gen), torch.randn(4, 2000, 48, generator=gen)
    with _threads(1):
        one = batched_rows(a, b)
    with _threads(2):
        two = batched_rows(a, b)
    assert torch.equal(one, two)
    torch.testing.assert_close(one, torch.bmm(a, b), rtol=1e-5, atol=1e-4)


def test_switch_off_restores_the_plain_products(monkeypatch):
    monkeypatch.setattr(batch_invariant, "BATCH_INVARIANT", False)
    x, w = torch.randn(37, 256), torch.randn(96, 256)
    assert torch.equal(linear_rows(x, w), F.linear(x, w))
    assert torch.equal(pointwise_rows(torch.sigmoid, x), torch.sigmoid(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_linear_row_spans_gives_each_row_what_linear_rows_gives_it(dtype, stage_device):
    """A MoE chunk's expert spans in one call: every row as `linear_rows` computes it alone with its span's weight."""
    from kimi_nvfp4.model.batch_invariant import linear_row_spans

    gen = torch.Generator().manual_seed(11)
    x = torch.randn(300, 256, generator=gen).to(device=stage_device, dtype=dtype)
    weights = [torch.randn(96, 256, generator=gen).to(device=stage_device, dtype=dtype) for _ in range(3)]
    spans = [(0, 130), (130, 131), (131, 300)]
    out = torch.full((300, 96), float("nan"), dtype=dtype, device=stage_device)
    linear_row_spans(x, spans, weights, out)
    for (a, b), w in zip(spans, weights):
        for row in (a, b - 1, (a + b) // 2):
            assert torch.equal(out[row], linear_rows(x[row : row + 1], w)[0])
