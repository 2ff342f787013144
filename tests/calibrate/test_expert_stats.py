"""`calibrate --expert-stats`: the per-layer statistics files equal a direct computation from the rows the model
fed each routed expert, on the demo model; `none` (the default) changes nothing calibrate wrote before."""

from __future__ import annotations

import pytest
import torch

from kimi_nvfp4.calibrate import calibrate_checkpoint
from kimi_nvfp4.calibrate import expert_stats as expert_stats_module
from kimi_nvfp4.calibrate.expert_stats_file import (
    EXPERT_STATS_DIR,
    layer_stats_name,
    read_layer_counts,
    read_layer_stats,
)
from kimi_nvfp4.checkpoint.manifest import load_manifest
from kimi_nvfp4.checkpoint.writer import sha256_file
from kimi_nvfp4.convert.api import convert_checkpoint
from kimi_nvfp4.demo_model import DEMO_CHECKPOINT
from kimi_nvfp4.numerics.methods.output_aware.refine import DENSE_MIN_TOKENS_PER_CHANNEL

SAMPLES, SEQ_LEN = 8, 128
GROUP_OF = {"gate_proj": "gate_up", "down_proj": "down"}


@pytest.fixture(scope="module")
def _demo_converted(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo") / "out"
    convert_checkpoint(DEMO_CHECKPOINT, out, device="cpu", progress=False)
    return out


@pytest.fixture
def demo_pair(tmp_path, _demo_converted):
    import shutil

    dst = tmp_path / "out"
    shutil.copytree(_demo_converted, dst)
    return DEMO_CHECKPOINT, dst


def _calibrate(src, out, **kw):
    return calibrate_checkpoint(out, src, "sample", samples=SAMPLES, seq_len=SEQ_LEN, device="cpu", progress=False,
                                **kw)


def test_expert_stats_files_equal_a_direct_computation(demo_pair, monkeypatch):
    src, out = demo_pair
    rows: dict[tuple[int, int, str], list[torch.Tensor]] = {}
    shared: dict[int, list[torch.Tensor]] = {}
    real = expert_stats_module.ExpertStatsObserver.on_linear

    def recording(self, layer, module, x, y, expert=None, routed=True):
        proj = module.rsplit(".", 1)[-1]
        if routed and expert is not None and proj in GROUP_OF:
            rows.setdefault((layer, expert, GROUP_OF[proj]), []).append(x.detach().double().clone())
        if routed and module == "mlp.shared_experts.gate_proj":
            shared.setdefault(layer, []).append(x.detach().double().clone())
        return real(self, layer, module, x, y, expert=expert, routed=routed)

    monkeypatch.setattr(expert_stats_module.ExpertStatsObserver, "on_linear", recording)
    report = _calibrate(src, out, expert_stats="hessian")

    folder = out / "calibration" / EXPERT_STATS_DIR
    entry = load_manifest(out).stages["calibrate"].outputs["expert_stats"]
    moe_layers = [entry.layer for entry in report.layers if entry.is_moe]
    assert sorted(entry["files"]) == [layer_stats_name(layer) for layer in moe_layers]
    dense = fallback = 0
    for layer_report in (e for e in report.layers if e.is_moe):
        layer = layer_report.layer
        path = folder / layer_stats_name(layer)
        assert entry["files"][path.name] == sha256_file(path)
        stats = read_layer_stats(path)
        assert stats.layer == layer
        for (e, group), got in stats.experts.items():
            x = torch.cat(rows[(layer, e, group)])
            assert got.tokens == x.shape[0] == layer_report.experts.tokens[e]  # the router's own count
            torch.testing.assert_close(got.channel_energy, x.square().mean(0), rtol=1e-9, atol=1e-12)
            if x.shape[0] >= DENSE_MIN_TOKENS_PER_CHANNEL * x.shape[1]:
                torch.testing.assert_close(got.hessian, (x.T @ x / x.shape[0]).float().double(), rtol=1e-5,
                                           atol=1e-7)
                norms = x.square().sum(1)
                assert got.mean_norm_fourth == pytest.approx(float(norms.square().mean()), rel=1e-9)
                assert got.mean_fourth_power == pytest.approx(float(x.pow(4).sum(1).mean()), rel=1e-9)
                dense += 1
            else:
                assert got.hessian is None
                fallback += 1
        seen = {(e, g) for (lay, e, g) in rows if lay == layer}
        assert set(stats.experts) == seen  # every expert input that saw tokens, nothing else
        x = torch.cat(shared[layer])
        assert stats.shared["gate_up"].tokens == x.shape[0]
        torch.testing.assert_close(stats.shared["gate_up"].channel_energy, x.square().mean(0), rtol=1e-9, atol=1e-12)
        counts = read_layer_counts(path)
        assert counts.dense + counts.diagonal_fallback == len(stats.experts) and counts.shared_gate_up
    assert dense > 0 and fallback > 0  # the demo data exercises both
    assert (entry["dense"], entry["diagonal_fallback"]) == (dense, fallback)


def test_diag_stats_carry_no_hessian(demo_pair):
    src, out = demo_pair
    _calibrate(src, out, expert_stats="diag")
    stats = read_layer_stats(sorted((out / "calibration" / EXPERT_STATS_DIR).glob("*.safetensors"))[0])
    assert stats.experts and all(s.hessian is None for s in stats.experts.values())
    assert load_manifest(out).stages["calibrate"].settings["expert_stats"] == "diag"


def test_no_expert_stats_by_default_and_the_record_is_unchanged(demo_pair):
    src, out = demo_pair
    _calibrate(src, out)
    assert not (out / "calibration" / EXPERT_STATS_DIR).exists()
    record = load_manifest(out).stages["calibrate"]
    assert "expert_stats" not in record.settings and "expert_stats" not in record.outputs


# On CUDA (the H200 run: the fused activation quantizer in the advance pass, float32 sums, float32 compute so
# that the recorded rows are what was summed) the sums are float32: 1e-5 relative instead of float64's 1e-9.
W4A4_TOLERANCES = {"cpu": (1e-9, 1e-12), "cuda": (1e-5, 1e-7)}  # (rtol, atol)


def test_w4a4_stats_are_the_served_inputs_and_their_quantized_twins(demo_pair, monkeypatch, stage_device):
    """`w4a4`: recorded in the W4A4 advance pass (not the observe pass), x~ being x fake-quantized with the
    layer's static gate/up (down) input scale after SGLang's layer-max reduction, read back from the checkpoint."""
    from safetensors.torch import load_file

    from kimi_nvfp4.numerics.nvfp4 import fake_quantize_activation_nvfp4

    rtol, atol = W4A4_TOLERANCES[stage_device]
    src, out = demo_pair
    rows: dict[tuple[int, int, str], list[torch.Tensor]] = {}
    real = expert_stats_module.ExpertStatsObserver.on_linear

    def recording(self, layer, module, x, y, expert=None, routed=True):
        proj = module.rsplit(".", 1)[-1]
        if self._linears is not None and routed and expert is not None and proj in GROUP_OF:
            rows.setdefault((layer, expert, GROUP_OF[proj]), []).append(x.detach().float().cpu().clone())
        return real(self, layer, module, x, y, expert=expert, routed=routed)

    monkeypatch.setattr(expert_stats_module.ExpertStatsObserver, "on_linear", recording)
    calibrate_checkpoint(out, src, "sample", samples=SAMPLES, seq_len=SEQ_LEN, device=stage_device, progress=False,
                         expert_stats="w4a4", dtype="float32")
    record = load_manifest(out).stages["calibrate"]
    assert record.settings["expert_stats"] == "w4a4" and record.outputs["expert_stats"]["mode"] == "w4a4"
    scales = {}
    for path in out.glob("*.safetensors"):
        scales.update({k: v for k, v in load_file(path).items() if k.endswith(".input_scale")})
    checked = 0
    for path in sorted((out / "calibration" / EXPERT_STATS_DIR).glob("*.safetensors")):
        stats = read_layer_stats(path)
        layer = stats.layer
        projs = {"gate_up": ("gate_proj", "up_proj"), "down": ("down_proj",)}
        layer_max = {g: max(float(v) for k, v in scales.items() if f"layers.{layer}.mlp.experts." in k
                            and k.rsplit(".", 2)[-2] in p) for g, p in projs.items()}
        assert set(stats.experts) == {(e, g) for (lay, e, g) in rows if lay == layer}
        for (e, group), got in stats.experts.items():
            x = torch.cat(rows[(layer, e, group)])
            xq = fake_quantize_activation_nvfp4(x, torch.tensor(layer_max[group])).double()
            x = x.double()
            assert got.quantized is not None and got.tokens == x.shape[0]
            torch.testing.assert_close(got.quantized.energy, xq.square().mean(0), rtol=rtol, atol=atol)
            torch.testing.assert_close(got.quantized.cross_energy, (x * xq).mean(0), rtol=rtol, atol=atol)
            if got.hessian is not None:
                n = x.shape[0]
                torch.testing.assert_close(got.quantized.hessian, (xq.T @ xq / n).float().double(), rtol=1e-5,
                                           atol=1e-7)
                torch.testing.assert_close(got.quantized.cross, (x.T @ xq / n).float().double(), rtol=1e-5,
                                           atol=1e-7)
                checked += 1
            assert not torch.equal(got.quantized.energy, got.channel_energy)  # the inputs were quantized
        assert stats.shared["gate_up"].quantized is not None
    assert checked > 0


def test_w4a4_stats_leave_the_input_scales_unchanged(demo_pair, tmp_path):
    """Observing the advance pass changes nothing it computes: the same scales as calibrating with hessian."""
    import shutil

    src, out = demo_pair
    other = tmp_path / "hessian"
    shutil.copytree(out, other)
    hessian = _calibrate(src, other, expert_stats="hessian")
    served = _calibrate(src, out, expert_stats="w4a4")
    assert served.shard_sha256 == hessian.shard_sha256


def test_combine_ranks_adds_every_sum_of_the_w4a4_statistics():
    """Two ranks that saw the same rows (an all-reduce that doubles): every running sum, the quantized ones
    included, doubles with the token count, so the means are unchanged and nothing is left rank-local."""
    from types import SimpleNamespace

    observer = expert_stats_module.ExpertStatsObserver(expert_stats_module.ExpertStatsMode.W4A4)
    observer.start_layer(1)
    acc = observer._accumulator(32)
    rows = torch.randn(40, 32, dtype=torch.float64)
    acc.add(rows, rows.round())
    observer.experts[(0, "gate_up")] = acc
    before = [t.clone() for t in acc.sums()]
    ctx = SimpleNamespace(distributed=True, all_reduce_sum_=lambda t: t.mul_(2))
    observer.combine_ranks(ctx, {"gate_up": 32, "down": 16}, n_experts=2)
    assert acc.tokens == 80 and len(before) == 7  # energies, fourth moments, H, and the four quantized sums
    assert all(torch.equal(after, 2 * b) for after, b in zip(acc.sums(), before))
    assert observer.experts[(1, "down")].quantized and observer.shared.quantized

