"""Pinned sha256 of every output shard of the 5-shard tiny checkpoint, per method.

Recorded before the throughput work; output bytes must not depend on how the conversion is scheduled
(workers, batching, --no-stats). Shards 1, 4 and 5 hold only pass-through tensors.
"""

from __future__ import annotations

import pytest

from kimi_nvfp4.checkpoint.manifest import load_manifest
from kimi_nvfp4.convert import convert_checkpoint

_PASS_THROUGH = {
    "model-00001-of-000005.safetensors": "dc2a3258d55b51e74e61b5a6a966b8280cc5d00a38e5f5dc530c45dc32a6f967",
    "model-00004-of-000005.safetensors": "dbd297f6a2e4191b60b927e8b84f7873f2c8171a627ca32a45024bfe56aa8e43",
    "model-00005-of-000005.safetensors": "bd712a87079af0d05d138d69ae63202dba84ce4e0b6ca37af01c19fd870f7ff8",
}
PINNED_SHARDS = {
    "amax": {
        **_PASS_THROUGH,
        "model-00002-of-000005.safetensors": "8e852cc052dce5e865daeee29ff70d891eeefb9631b9890ba635e3ef56e56763",
        "model-00003-of-000005.safetensors": "668be6d387d6031c2c2987144aa5ea509c1c1fd327704aede1d5fb2ae6dbd8ae",
    },
    "int4-aware": {
        **_PASS_THROUGH,
        "model-00002-of-000005.safetensors": "a0aeb2611356ca93644cbdfce34afe1c2277b92c34215f0566380e04e3af0b28",
        "model-00003-of-000005.safetensors": "275fe9caec931dc037d42035522dba54908d354afe2f7f3bc22b6f5f75334d75",
    },
    "sweep": {
        **_PASS_THROUGH,
        "model-00002-of-000005.safetensors": "53f91ee722b66a5beb2cd3c27376adc87179f2a41bab1ade3552cf1b98a5a094",
        "model-00003-of-000005.safetensors": "1de7759bc06e4a9983960ae570703f68c33579a361102c8c01ed56de01d5a2a8",
    },
}


def _shard_digests(out) -> dict[str, str]:
    return {f: r.sha256 for f, r in load_manifest(out).shards.items()}


@pytest.mark.parametrize("method", sorted(PINNED_SHARDS))
def test_output_shards_are_pinned(source, tmp_path, method):
    out = tmp_path / "out"
    convert_checkpoint(source, out, method=method, device="cpu", progress=False)
    assert _shard_digests(out) == PINNED_SHARDS[method]


@pytest.mark.parametrize("method", ["amax", "int4-aware"])
def test_workers_and_no_stats_do_not_change_the_pinned_bytes(source, tmp_path, method):
    out = tmp_path / "out"
    convert_checkpoint(source, out, method=method, device="cpu", workers=3, record_stats=False, progress=False)
    assert _shard_digests(out) == PINNED_SHARDS[method]
    assert load_manifest(out).tensor_stats == {}
