"""Pinned output bytes of `quantize_int4_matrices` per method.

Recorded before the throughput work (batched numerics, faster E2M1 encode); any change to a single
output byte fails here. Matrices cover gate/up pairs with different magnitudes, a down matrix, and edge
cases: all-zero groups, saturating rows, every INT4 code, block scales clamped at 2**-9, a huge scale.
If a digest must change on purpose, say why in the commit and re-check Model Optimizer parity.
"""

from __future__ import annotations

import hashlib

import pytest
import torch

from kimi_nvfp4.numerics.methods import Int4Matrix, ScaleMethod, SearchPath, quantize_int4_matrices

from .conftest import realistic_int4

PINNED_SHA256 = {
    ScaleMethod.AMAX: "f7f2c9b84120408d829418b006c27ea2dc517155cc3a9634ea3ae930d9e0a1ae",
    ScaleMethod.INT4_AWARE: "a0858bb243406deda8306e2c7b19d22c7b2257c12b5dc1b50bd0515f84678fab",
    ScaleMethod.SWEEP: "61e9fcca00264384cbb9aaa6092542c5933a99489237279a453ae994056b357e",
}
_TINY_GROUP_SCALE = 2.0**-20  # block scale falls below E4M3's 2**-9 and is clamped
_HUGE_GROUP_SCALE = 3.0e4


def edge_case_matrix() -> Int4Matrix:
    m = realistic_int4(64, 512, seed=7, row_spread=1.5)
    codes, scale = m.codes.clone(), m.group_scale.clone()
    codes[0:4, 0:32] = 0
    codes[4, :] = 7
    codes[5, :] = -8
    codes[6, :] = torch.arange(512) % 16 - 8
    scale[7:9] = _TINY_GROUP_SCALE
    scale[9] = _HUGE_GROUP_SCALE
    return Int4Matrix(codes, scale)


def scale_groups() -> list[list[Int4Matrix]]:
    return [
        [realistic_int4(128, 1024, seed=1), realistic_int4(128, 1024, seed=2, row_spread=1.0)],
        [realistic_int4(256, 256, seed=3)],
        [edge_case_matrix()],
    ]


def digest(method: ScaleMethod, groups: list[list[Int4Matrix]], path: SearchPath | None = None) -> str:
    d = hashlib.sha256()
    for mats in groups:
        for q in quantize_int4_matrices(mats, method, path=path):
            for t in (q.weight, q.weight_scale.view(torch.uint8), q.weight_scale_2.reshape(1).view(torch.uint8)):
                d.update(t.cpu().contiguous().numpy().tobytes())
    return d.hexdigest()


@pytest.mark.parametrize("path", [None, SearchPath.REFERENCE], ids=["default-path", "reference"])
@pytest.mark.parametrize("method", list(PINNED_SHA256), ids=lambda m: m.value)
def test_quantize_int4_matrices_bytes_are_pinned(method, path):
    """On the CPU the default path is the byte tables; the reference path must give the same bytes."""
    assert digest(method, scale_groups(), path) == PINNED_SHA256[method]


@pytest.mark.parametrize("method", list(PINNED_SHA256), ids=lambda m: m.value)
def test_row_steps_do_not_change_the_bytes(method, monkeypatch):
    """Many small steps (as for K2.6-sized matrices) give the pinned bytes of one big step."""
    import kimi_nvfp4.numerics.methods.search.encode as encode_module
    import kimi_nvfp4.numerics.methods.search.reference as reference_module

    monkeypatch.setattr(encode_module, "_ENCODE_STEP_ELEMENTS", {"cpu": 7 * 1024})
    monkeypatch.setattr(reference_module, "_WORK_ELEMENTS", {"cpu": 5 * 64 * 126 * 8})
    for path in (None, SearchPath.REFERENCE):
        assert digest(method, scale_groups(), path) == PINNED_SHA256[method]
