"""Calibration with host-resident states (pinned memory, transfers overlapped with compute: model/host_states.py)
chooses the same input scales as with the states on the GPU."""

from __future__ import annotations

import pytest
import torch

from kimi_nvfp4.calibrate import ExpertPolicy
from kimi_nvfp4.calibrate.api import run_calibration
from kimi_nvfp4.checkpoint.reader import CheckpointReader


@pytest.mark.gpu
@pytest.mark.parametrize("chunk", [24, None], ids=["many-chunks", "default-chunks"])
def test_host_states_give_the_same_scales(converted_pair, cuda_device, chunk):
    _src, out = converted_pair
    reader = CheckpointReader(out)
    seqs = [torch.randint(0, 5000, (n,), generator=torch.Generator().manual_seed(i)) for i, n in enumerate((32, 7, 50))]
    runs = {
        where: run_calibration(reader, seqs, policy=ExpertPolicy.PEER_MAX, min_expert_tokens=4, device=cuda_device,
                               progress=False, states_device=where, max_chunk_tokens=chunk, kv_cache=True)
        for where in ("cuda", "cpu")
    }
    gpu, host = runs["cuda"], runs["cpu"]
    assert gpu.scales.keys() == host.scales.keys() and gpu.scales
    assert all(torch.equal(gpu.scales[k], host.scales[k]) for k in gpu.scales)
    assert [e.model_dump() for e in gpu.layers] == [e.model_dump() for e in host.layers]
    for k in gpu.kv_ranges.latent:
        assert torch.equal(gpu.kv_ranges.latent[k], host.kv_ranges.latent[k])
