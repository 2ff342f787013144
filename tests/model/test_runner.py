"""LayerStreamRunner: chunking invariance, observers (incl. route_all), token chunks, bad input."""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch

from kimi_nvfp4.model import LayerStreamRunner, NullObserver, Observer, open_weights
from kimi_nvfp4.model.runner import token_chunks

GEN = torch.Generator().manual_seed(1)


def sequences(*lengths):
    return [torch.randint(0, 512, (n,), generator=GEN) for n in lengths]


class Recorder(NullObserver):
    def __init__(self, route_all=False):
        self.route_all = route_all
        self.rows = defaultdict(int)  # (layer, module, routed) -> rows seen
        self.routers = []

    def on_linear(self, layer, module, x, y, expert=None, routed=True):
        assert x.shape[0] == y.shape[0]
        if expert is not None:
            assert f".experts.{expert}." in module
        self.rows[(layer, module, routed)] += x.shape[0]

    def on_router(self, layer, topk_ids, topk_weights):
        self.routers.append((layer, topk_ids.clone(), topk_weights.clone()))


def test_token_chunks_cover_everything_once():
    lengths = [5, 0, 9, 3]
    for budget in (1, 4, 7, 100, None):
        chunks = list(token_chunks(lengths, budget))
        assert all(sum(b - a for _, a, b in c) <= (budget or 10**9) for c in chunks)
        covered = [(si, p) for c in chunks for si, a, b in c for p in range(a, b)]
        assert covered == [(si, p) for si, n in enumerate(lengths) for p in range(n)]


def test_chunking_does_not_change_logits(tiny_src):
    source = open_weights(tiny_src)
    seqs = sequences(13, 1, 30)
    whole = list(LayerStreamRunner(source, max_chunk_tokens=None, progress=False).run(seqs))
    chunked = list(LayerStreamRunner(source, max_chunk_tokens=4, progress=False).run(seqs))
    for a, b in zip(whole, chunked):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)


def test_batching_does_not_change_logits(tiny_src):
    """Each sequence attends only to itself: alone or in a batch, same logits."""
    source = open_weights(tiny_src)
    seqs = sequences(9, 17)
    runner = LayerStreamRunner(source, progress=False)
    together = list(runner.run(seqs))
    alone = [next(runner.run([s])) for s in seqs]
    for a, b in zip(together, alone):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)


def test_apply_layer_step_by_step_equals_run(tiny_src):
    runner = LayerStreamRunner(open_weights(tiny_src), progress=False)
    seqs = sequences(6, 4)
    states = runner.embed(seqs)
    assert states.lengths == [6, 4] and states.num_tokens == 10
    for i in range(runner.num_layers):
        states = runner.apply_layer(i, states)
    for a, b in zip(runner.logits(states), runner.run(seqs)):
        assert torch.equal(a, b)


def test_observer_sees_every_linear_and_routed_rows(tiny_src):
    source = open_weights(tiny_src)
    cfg = source.config
    rec = Recorder()
    assert isinstance(rec, Observer)
    seqs = sequences(11, 7)
    list(LayerStreamRunner(source, max_chunk_tokens=8, progress=False).run(seqs, observer=rec))
    n = 18
    for layer in range(cfg.num_hidden_layers):
        for m in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"):
            assert rec.rows[(layer, f"self_attn.{m}", True)] == n
    assert rec.rows[(0, "mlp.gate_proj", True)] == n and rec.rows[(0, "mlp.down_proj", True)] == n
    for layer in cfg.moe_layers:
        assert rec.rows[(layer, "mlp.shared_experts.up_proj", True)] == n
        expert_rows = sum(rec.rows[(layer, f"mlp.experts.{e}.gate_proj", True)] for e in range(cfg.n_routed_experts))
        assert expert_rows == n * cfg.num_experts_per_tok
        ids = torch.cat([ids for lay, ids, _ in rec.routers if lay == layer])
        for e in range(cfg.n_routed_experts):
            assert rec.rows[(layer, f"mlp.experts.{e}.down_proj", True)] == int((ids == e).sum())
    weights = torch.cat([w for _, _, w in rec.routers])
    assert torch.allclose(weights.sum(-1), torch.full((weights.shape[0],), cfg.routed_scaling_factor))
    assert not any(routed is False for (_, _, routed) in rec.rows)


def test_route_all_reports_every_token_without_changing_output(tiny_src):
    source = open_weights(tiny_src)
    cfg = source.config
    seqs = sequences(10, 5)
    plain = list(LayerStreamRunner(source, progress=False).run(seqs))
    rec = Recorder(route_all=True)
    observed = list(LayerStreamRunner(source, progress=False).run(seqs, observer=rec))
    for a, b in zip(plain, observed):
        assert torch.equal(a, b)
    for layer in cfg.moe_layers:
        for e in range(cfg.n_routed_experts):
            for p in ("gate_proj", "up_proj", "down_proj"):
                assert rec.rows[(layer, f"mlp.experts.{e}.{p}", False)] == 15


def test_deepseek_v3_layout_gives_same_logits(tiny_src, tmp_path):
    """The K2-Thinking layout (no `language_model.` prefix, plain DeepseekV3 config) of the same weights."""
    import json

    from safetensors.torch import save_file

    from kimi_nvfp4.checkpoint.reader import CheckpointReader

    reader = CheckpointReader(tiny_src)
    prefix = "language_model."
    tensors = {n[len(prefix):]: reader.load(n) for n in reader.weight_map if n.startswith(prefix)}
    thinking = tmp_path / "thinking"
    thinking.mkdir()
    save_file(tensors, str(thinking / "model.safetensors"))
    config = dict(reader.config["text_config"], architectures=["DeepseekV3ForCausalLM"])
    (thinking / "config.json").write_text(json.dumps(config))
    seqs = sequences(8)
    a = next(LayerStreamRunner(open_weights(tiny_src), progress=False).run(seqs))
    b = next(LayerStreamRunner(open_weights(thinking), progress=False).run(seqs))
    assert torch.equal(a, b)


def test_states_can_live_on_another_device(tiny_src):
    source = open_weights(tiny_src)
    seqs = sequences(5)
    a = next(LayerStreamRunner(source, progress=False).run(seqs))
    b = next(LayerStreamRunner(source, states_device="cpu", progress=False).run(seqs))
    assert torch.equal(a, b)


def test_out_of_range_token_ids_are_refused(tiny_src):
    runner = LayerStreamRunner(open_weights(tiny_src), progress=False)
    with pytest.raises(ValueError, match=r"sequence 1: token ids must lie in \[0, 512\)"):
        runner.embed([torch.tensor([1, 2]), torch.tensor([600])])


@pytest.mark.gpu
@pytest.mark.parametrize("ckpt", ["tiny_src", "tiny_nvfp4_calibrated"])
def test_cuda_matches_cpu(ckpt, request, cuda_device):
    source = open_weights(request.getfixturevalue(ckpt))
    seqs = sequences(12, 3)
    cpu = list(LayerStreamRunner(source, progress=False).run(seqs))
    gpu = list(LayerStreamRunner(source, device=cuda_device, states_device="cpu", progress=False).run(seqs))
    # fp32 summation orders differ between devices; in W4A4 a rare activation on an E2M1 rounding
    # boundary may flip a code, hence a norm-wise bound rather than elementwise
    for a, b in zip(cpu, gpu):
        assert float((a - b.cpu()).norm() / a.norm()) < 1e-3


def test_bfloat16_compute_tracks_fp32(tiny_src, tiny_nvfp4_calibrated):
    """dtype=bf16 (the serving activation dtype) runs every path and stays close to fp32."""
    seqs = sequences(16)
    for ckpt in (tiny_src, tiny_nvfp4_calibrated):
        source = open_weights(ckpt)
        ref = next(LayerStreamRunner(source, progress=False).run(seqs))
        low = next(LayerStreamRunner(source, dtype=torch.bfloat16, progress=False).run(seqs))
        assert low.dtype == torch.bfloat16
        assert float((low.float() - ref).norm() / ref.norm()) < 0.05


def test_prefetch_and_materialize_give_identical_logits(tiny_src):
    source = open_weights(tiny_src)
    seqs = sequences(9, 4)
    plain = list(LayerStreamRunner(source, progress=False).run(seqs))
    fast = list(LayerStreamRunner(source, progress=False, prefetch=True, materialize_layers=True).run(seqs))
    for a, b in zip(plain, fast):
        assert torch.equal(a, b)
    runner = LayerStreamRunner(source, progress=False, prefetch=True)
    states = runner.embed(seqs)
    runner.prefetch(2)  # a prefetch of the wrong layer is dropped, not used
    states = runner.apply_layer(0, states)
    assert runner._pending is not None and runner._pending[0] == 1
