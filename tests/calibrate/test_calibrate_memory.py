"""Memory bound: calibration holds one decoder layer at a time plus the calibration hidden states."""

from __future__ import annotations

import weakref

import pytest
import torch

from kimi_nvfp4.calibrate import ExpertPolicy
from kimi_nvfp4.calibrate.api import run_calibration
from kimi_nvfp4.checkpoint.reader import CheckpointReader
from kimi_nvfp4.model import weights as model_weights
from kimi_nvfp4.stage_kit.layer_memory import peak_allocated, reset_peak


class LiveLayers:
    """Counts LayerWeights objects alive at once (CPython frees them as soon as the last reference goes)."""

    def __init__(self):
        self.live = 0
        self.peak = 0
        self.loaded = 0

    def wrap(self, original):
        def layer(source, i, *args, **kwargs):
            w = original(source, i, *args, **kwargs)
            self.live += 1
            self.loaded += 1
            self.peak = max(self.peak, self.live)
            weakref.finalize(w, self._freed)
            return w

        return layer

    def _freed(self):
        self.live -= 1


@pytest.fixture
def live_layers(monkeypatch) -> LiveLayers:
    counter = LiveLayers()
    monkeypatch.setattr(model_weights._CheckpointWeights, "layer", counter.wrap(model_weights._CheckpointWeights.layer))
    return counter


@pytest.mark.parametrize("policy", list(ExpertPolicy), ids=lambda p: p.value)
def test_one_layer_at_a_time(converted_pair, live_layers, policy):
    _src, out = converted_pair
    reader = CheckpointReader(out)
    seqs = [torch.randint(0, 5000, (16,), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    run_calibration(reader, seqs, policy=policy, min_expert_tokens=4, device=torch.device("cpu"), progress=False)
    cfg = reader.layout.text
    # loaded once per layer: the W4A4 advance pass reuses the observe pass's weights
    assert live_layers.loaded == cfg.num_hidden_layers
    assert live_layers.peak == 1
    assert live_layers.live == 0


@pytest.mark.gpu
def test_gpu_peak_memory_is_one_layer_plus_states(converted_pair, cuda_device):
    """The peak is what the memory planner estimates for this run (stage_kit/memory_estimate.py): the layer as stored,
    the next one prefetched, the layer dequantized once, the states and one chunk's work. The old bound (8 layers +
    4 state copies + 32 MiB) left out the prefetched layer and failed by 0.9 MB on the H200."""
    from kimi_nvfp4.model.runner import CUDA_MAX_CHUNK_TOKENS
    from kimi_nvfp4.stage_kit.memory_estimate import GPU_HEADROOM_BYTES, estimate

    _src, out = converted_pair
    reader = CheckpointReader(out)
    cfg = reader.layout.text
    seqs = [torch.randint(0, 5000, (64,), generator=torch.Generator().manual_seed(i)) for i in range(8)]
    planned, _host, _parts = estimate(
        cfg, stage="calibrate", device=cuda_device, dtype=torch.bfloat16, tokens=sum(s.numel() for s in seqs),
        seq_len=64, streams=1, sources=1, states_on_device=True, chunk_tokens=CUDA_MAX_CHUNK_TOKENS,
        materialize=True, prefetch=True)
    reset_peak(cuda_device)
    base = torch.cuda.memory_allocated(cuda_device)
    run_calibration(reader, seqs, policy=ExpertPolicy.PEER_MAX, min_expert_tokens=4, device=cuda_device, progress=False,
                    materialize=True, prefetch=True)
    peak = peak_allocated(cuda_device) - base
    # the plan's headroom (cuBLAS workspaces, allocator rounding, Triton) is not allocated by the stage's tensors
    # but cuBLAS's workspaces are, through the caching allocator: 32 MiB of them at this size
    assert peak <= planned - GPU_HEADROOM_BYTES + 32 * 2**20


@pytest.mark.gpu
def test_gpu_and_cpu_agree(converted_pair, cuda_device):
    """Same statistics on CUDA and CPU up to fp32 summation order (routing near-ties aside, layer maxima match)."""
    _src, out = converted_pair
    reader = CheckpointReader(out)
    seqs = [torch.randint(0, 5000, (32,), generator=torch.Generator().manual_seed(i)) for i in range(4)]
    runs = [
        run_calibration(
            reader, seqs, policy=ExpertPolicy.PEER_MAX, min_expert_tokens=4, device=d, progress=False, dtype="float32"
        )
        for d in (torch.device("cpu"), cuda_device)
    ]
    for a, b in zip(*(r.layers for r in runs)):
        if a.experts is not None:
            assert b.gate_up_amax_max == pytest.approx(a.gate_up_amax_max, rel=1e-4)
            assert b.down_amax_max == pytest.approx(a.down_amax_max, rel=1e-4)
