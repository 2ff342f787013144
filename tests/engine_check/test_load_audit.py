"""The loading audit on toy modules (no engine): sentinels, loader tracing, landing, fused loads."""

from __future__ import annotations

import torch

from kimi_nvfp4.engine_check.load_audit import LoadRecorder, fill_sentinels, int_sentinel, unwritten_mask


def _copy_loader(param, loaded, *args, **kwargs):
    param.data.copy_(loaded)


def _params(**tensors: torch.Tensor) -> dict[str, torch.nn.Parameter]:
    out = {}
    for name, t in tensors.items():
        p = torch.nn.Parameter(t, requires_grad=False)
        out[name] = p
    return out


def test_sentinels_find_the_elements_a_loader_never_wrote():
    params = _params(w=torch.empty(4, 3, dtype=torch.bfloat16), s=torch.empty(4, 2, dtype=torch.float8_e4m3fn))
    fill_sentinels(params)
    params["w"].data[:3] = 1.0  # row 3 never written
    params["s"].data.copy_(torch.ones(4, 2))
    assert unwritten_mask(params["w"]).sum() == 3 and unwritten_mask(params["w"])[3].all()
    assert not unwritten_mask(params["s"]).any()


def test_integer_parameters_need_both_sentinels():
    """A packed E2M1 byte may legitimately be 0xFF: only an element holding the sentinel in both runs is unwritten."""
    p = _params(codes=torch.empty(2, 4, dtype=torch.uint8))["codes"]
    real = torch.tensor([[0xFF, 1, 2, 3], [4, 5, 6, 7]], dtype=torch.uint8)
    fill_sentinels({"c": p}, which=0)
    p.data[0] = real[0]  # row 1 never written; row 0 holds a real 0xFF
    first = unwritten_mask(p, which=0)
    assert int_sentinel(torch.uint8, 0) == 0xFF and first.sum() == 5  # the real 0xFF looks unwritten once
    fill_sentinels({"c": p}, which=1)
    p.data[0] = real[0]
    assert (first & unwritten_mask(p, which=1)).sum() == 4  # only row 1


def test_recorder_traces_views_to_checkpoint_tensors_and_checks_landing():
    params = _params(w=torch.empty(2, 6, 4))
    params["w"].weight_loader = lambda p, t, expert: p.data[expert, : t.shape[0]].copy_(t)
    fill_sentinels(params)
    rec = LoadRecorder(params, measure_landing=True)
    rec.install(_copy_loader)
    ckpt = [("e0", torch.arange(24.0).reshape(6, 4)), ("e1", torch.ones(5, 4))]
    for name, t in rec.watch(ckpt):
        params["w"].weight_loader(params["w"], t[: t.shape[0]], int(name[1]))  # a view of the yielded tensor
    rec.uninstall()
    assert [c.sources for c in rec.calls] == [["e0"], ["e1"]]
    assert all(c.landed for c in rec.calls)
    assert "weight_loader" in params["w"].__dict__ and params["w"].weight_loader.__name__ == "<lambda>"
    assert unwritten_mask(params["w"]).sum() == 4  # expert 1's last row


def test_landing_accepts_zero_padding_and_scalar_broadcast_and_rejects_changed_values():
    params = _params(pad=torch.empty(4, 4), scale=torch.empty(3, 2), bad=torch.empty(2, 2))
    params["pad"].weight_loader = lambda p, t: (p.data.zero_(), p.data[:2, :3].copy_(t))
    params["scale"].weight_loader = lambda p, t, e: p.data[e].copy_(t)  # one scalar into both halves
    params["bad"].weight_loader = lambda p, t: p.data.copy_(t * 2)
    fill_sentinels(params)
    rec = LoadRecorder(params, measure_landing=True)
    rec.install(_copy_loader)
    for name, t in rec.watch([("a", torch.ones(2, 3)), ("b", torch.tensor(0.5)), ("c", torch.ones(2, 2))]):
        target = {"a": "pad", "b": "scale", "c": "bad"}[name]
        args = (1,) if target == "scale" else ()
        params[target].weight_loader(params[target], t, *args)
    landed = {c.parameter: (c.landed, c.detail) for c in rec.calls}
    assert landed["pad"] == (True, "zero-padded to [4, 4]")
    assert landed["scale"][0] is True and "broadcast" in landed["scale"][1]
    assert landed["bad"] == (False, "the written block differs from the checkpoint tensor")


def test_a_tensor_the_model_builds_is_traced_to_the_checkpoint_tensors_it_concatenates():
    """SGLang caches q_a_proj and kv_a_proj_with_mqa and loads their concatenation into one fused parameter."""
    fused = "m.layers.0.self_attn.fused_qkv_a_proj_with_mqa.weight"
    params = _params(**{fused: torch.empty(5, 2)})
    fill_sentinels(params)
    rec = LoadRecorder(params, measure_landing=True)
    rec.install(_copy_loader)
    q, kv = torch.randn(3, 2), torch.randn(2, 2)
    cached = {}
    for name, t in rec.watch([("m.layers.0.self_attn.kv_a_proj_with_mqa.weight", kv),
                              ("m.layers.0.self_attn.q_a_proj.weight", q)]):
        cached[name] = t
    params[fused].weight_loader(params[fused], torch.cat([q, kv]))
    rec.uninstall()
    parts, unexplained = rec.attribute_fused()
    assert parts == {fused: ["m.layers.0.self_attn.q_a_proj.weight", "m.layers.0.self_attn.kv_a_proj_with_mqa.weight"]}
    assert unexplained == [] and rec.routed() == set(cached)


def test_an_unexplained_built_tensor_is_reported():
    params = _params(**{"m.x.fused.weight": torch.empty(4, 2)})
    rec = LoadRecorder(params, measure_landing=False)
    rec.install(_copy_loader)
    for _ in rec.watch([("m.x.a.weight", torch.ones(2, 2)), ("m.x.b.weight", torch.ones(2, 2))]):
        pass
    params["m.x.fused.weight"].weight_loader(params["m.x.fused.weight"], torch.zeros(4, 2))  # not their concatenation
    _, unexplained = rec.attribute_fused()
    assert unexplained == ["m.x.fused.weight"] and rec.routed() == set()
