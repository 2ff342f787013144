"""Host-resident states (model/host_states.py): overlapping the transfers with the compute changes no bit.

On CUDA, each layer's `attend` and `feed_forward` give the same states whether the states live on the GPU or in
pinned host memory, with chunks that span sequences and many chunks in flight (small `max_chunk_tokens`)."""

from __future__ import annotations

import pytest
import torch

from kimi_nvfp4.model import LayerStreamRunner, NullObserver, open_weights

GEN = torch.Generator().manual_seed(7)


def _sequences(*lengths):
    return [torch.randint(0, 512, (n,), generator=GEN) for n in lengths]


class _Rows(NullObserver):
    """The sum of every linear's inputs, per module: what an observer sees must not change either."""

    def __init__(self):
        self.sums: dict[tuple[int, str], torch.Tensor] = {}

    def on_linear(self, layer, module, x, y, expert=None, routed=True):
        key = (layer, module)
        s = x.double().sum(0).cpu()
        self.sums[key] = self.sums[key] + s if key in self.sums else s


def _step_all_layers(runner: LayerStreamRunner, seqs, observer=None):
    """Per layer: (post-attention residual, layer output), each copied to the CPU after the call returned."""
    states = runner.embed(seqs)
    out = []
    for i in range(runner.num_layers):
        w = runner.load_layer(i)
        attended = runner.attend(i, states, w, observer)
        snap = [s.clone().cpu() for s in attended.sequences]
        assert runner.feed_forward(attended, w, observer, output=False) is None  # statistics only: no write
        assert all(torch.equal(a.cpu(), b) for a, b in zip(attended.sequences, snap))
        states = runner.feed_forward(attended, w, observer)
        out.append((snap, [s.clone().cpu() for s in states.sequences]))
    return out, states


@pytest.mark.gpu
@pytest.mark.parametrize("ckpt", ["tiny_src", "tiny_nvfp4_calibrated"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("chunk", [5, 16, None], ids=["chunk5", "chunk16", "one-chunk"])
def test_host_states_are_bit_identical_to_gpu_states(ckpt, dtype, chunk, request, cuda_device):
    source = open_weights(request.getfixturevalue(ckpt))
    seqs = _sequences(13, 1, 29, 7, 40)
    results, observers = {}, {}
    for where in ("cuda", "cpu"):
        runner = LayerStreamRunner(source, device=cuda_device, dtype=dtype, max_chunk_tokens=chunk,
                                   states_device=where, progress=False)
        observers[where] = _Rows()
        results[where], states = _step_all_layers(runner, seqs, observers[where])
        if where == "cpu":
            assert runner.states_on_host and runner._host is not None  # the overlapped path ran
            assert all(s.device.type == "cpu" and s.is_pinned() for s in states.sequences)
    for (att_gpu, out_gpu), (att_host, out_host) in zip(results["cuda"], results["cpu"]):
        assert all(torch.equal(a, b) for a, b in zip(att_gpu, att_host))
        assert all(torch.equal(a, b) for a, b in zip(out_gpu, out_host))
    assert observers["cuda"].sums.keys() == observers["cpu"].sums.keys()
    assert all(torch.equal(observers["cuda"].sums[k], observers["cpu"].sums[k]) for k in observers["cuda"].sums)


@pytest.mark.gpu
def test_host_states_logits_match_and_are_readable_at_once(tiny_nvfp4_calibrated, cuda_device):
    """`run` end to end (apply_layer, logits), and the host states read by the CPU right after each call."""
    source = open_weights(tiny_nvfp4_calibrated)
    seqs = _sequences(64, 3, 100, 17)
    gpu = list(LayerStreamRunner(source, device=cuda_device, max_chunk_tokens=8, progress=False).run(seqs))
    runner = LayerStreamRunner(source, device=cuda_device, max_chunk_tokens=8, states_device="cpu", progress=False)
    host = list(runner.run(seqs))
    assert all(torch.equal(a, b) for a, b in zip(gpu, host))
    # the CPU reads without any synchronization of its own (as resume snapshots do)
    states = runner.embed(seqs)
    ref = LayerStreamRunner(source, device=cuda_device, max_chunk_tokens=8, progress=False)
    ref_states = ref.embed(seqs)
    for i in range(runner.num_layers):
        states = runner.apply_layer(i, states)
        ref_states = ref.apply_layer(i, ref_states)
        # read by the CPU straight from the pinned tensors
        assert all(torch.equal(s, r.cpu()) for s, r in zip(states.sequences, ref_states.sequences))
