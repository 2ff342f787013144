"""K2Model: cached forward == recompute, greedy/sampled generation, stop ids, prefix-cache reuse."""

from __future__ import annotations

import pytest
import torch

from kimi_nvfp4.model import K2Model, KVCache, LayerStreamRunner, generate, open_weights

TOL = {"rtol": 1e-5, "atol": 1e-5}


@pytest.fixture(scope="module")
def model(tiny_src):
    return K2Model(open_weights(tiny_src))


PROMPT = [5, 77, 301, 12, 9, 450, 33]


def scratch_logits(model, ids):
    logits, _ = model.forward(ids)
    return logits


def test_forward_matches_the_layer_streamed_runner(model, tiny_src):
    ids = torch.tensor(PROMPT)
    runner_logits = next(LayerStreamRunner(open_weights(tiny_src), progress=False).run([ids]))
    assert torch.allclose(scratch_logits(model, ids), runner_logits, **TOL)


def test_cached_forward_equals_recompute(model):
    full = scratch_logits(model, PROMPT)
    cache = None
    pieces = []
    for a, b in ((0, 3), (3, 4), (4, 7)):
        logits, cache = model.forward(PROMPT[a:b], cache)
        pieces.append(logits)
    assert cache.seq_len == len(PROMPT) and cache.token_ids == PROMPT
    assert torch.allclose(torch.cat(pieces), full, **TOL)


def test_greedy_generation_equals_recompute_from_scratch(model):
    result = model.generate(PROMPT, max_new_tokens=6)
    assert result.finish_reason == "length" and len(result.token_ids) == 6
    seq = list(PROMPT)
    for token, logprob in zip(result.token_ids, result.logprobs):
        last = scratch_logits(model, seq)[-1]
        assert token == int(last.argmax())
        assert logprob == pytest.approx(float(torch.log_softmax(last, -1)[token]), abs=1e-5)
        seq.append(token)
    assert result.cache.seq_len == len(PROMPT) + 5  # the last token is not fed back


def test_sampling_is_seeded_and_top_p_small_is_greedy(model):
    a = model.generate(PROMPT, 8, temperature=1.0, seed=11)
    b = generate(model, PROMPT, 8, temperature=1.0, seed=11)
    assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
    others = [model.generate(PROMPT, 8, temperature=1.0, seed=s).token_ids for s in range(12, 16)]
    assert any(o != a.token_ids for o in others)
    greedy = model.generate(PROMPT, 8)
    assert model.generate(PROMPT, 8, temperature=0.8, top_p=1e-9, seed=3).token_ids == greedy.token_ids


def test_stop_ids_end_generation(model):
    greedy = model.generate(PROMPT, 5)
    stop = greedy.token_ids[2]
    first = greedy.token_ids.index(stop)
    result = model.generate(PROMPT, 5, stop_ids=[stop])
    assert result.finish_reason == "stop"
    assert result.token_ids == greedy.token_ids[: first + 1]


def test_prefix_cache_reuse_gives_the_same_answer(model):
    first = model.generate(PROMPT, 4)
    kept = first.cache.clone()
    follow_up = PROMPT + first.token_ids + [42, 7]
    reused = model.generate(follow_up, 4, cache=first.cache)
    fresh = model.generate(follow_up, 4)
    assert reused.token_ids == fresh.token_ids
    assert reused.logprobs == pytest.approx(fresh.logprobs, abs=1e-5)
    # the caller's cache is left as it was
    assert first.cache.token_ids == kept.token_ids
    assert all(torch.equal(a.latent, b.latent) for a, b in zip(first.cache.layers, kept.layers))
    # a diverging prompt reuses only the common prefix
    other = model.generate([5, 77, 999 % 512, 1], 3, cache=first.cache)
    assert other.token_ids == model.generate([5, 77, 999 % 512, 1], 3).token_ids


def test_kv_cache_clone_and_truncate(model):
    _, cache = model.forward(PROMPT)
    copy = cache.clone()
    cache.truncate(3)
    assert cache.seq_len == 3 and cache.token_ids == PROMPT[:3]
    assert all(c.seq_len == 3 for c in cache.layers)
    assert copy.seq_len == len(PROMPT) and all(c.seq_len == len(PROMPT) for c in copy.layers)
    logits, _ = model.forward(PROMPT[3:], cache)
    assert torch.allclose(logits, scratch_logits(model, PROMPT)[3:], **TOL)
    with pytest.raises(ValueError, match="cannot truncate a 3-token cache to 4"):
        cache.truncate(4)
    assert KVCache.empty(2).truncate(0).seq_len == 0


def test_bad_arguments(model):
    with pytest.raises(ValueError, match="non-empty prompt"):
        model.generate([], 3)
    with pytest.raises(ValueError, match="top_p"):
        model.generate(PROMPT, 3, top_p=0.0)
    with pytest.raises(ValueError, match="token ids"):
        model.forward([512])


def test_fp8_kv_cache_rounds_what_is_read_back(tiny_src, model):
    fp8 = K2Model(open_weights(tiny_src), kv_cache_dtype=torch.float8_e4m3fn)
    # one call: nothing is read back from the cache, so the logits are the unrounded ones
    full, cache = fp8.forward(PROMPT)
    assert torch.equal(full, scratch_logits(model, PROMPT))
    for layer in cache.layers:
        assert torch.equal(layer.latent, layer.latent.to(torch.float8_e4m3fn).float())
    # two calls: the second reads the first's tokens from the fp8 cache -> close, not equal
    first, c = fp8.forward(PROMPT[:4])
    second, _ = fp8.forward(PROMPT[4:], c)
    assert torch.allclose(first, full[:4], **TOL)  # (matmul shapes differ: not bit-equal)
    plain_first, plain_cache = model.forward(PROMPT[:4])
    plain_second, _ = model.forward(PROMPT[4:], plain_cache)
    assert torch.equal(first, plain_first)
    assert float((second - plain_second).abs().max()) > 1e-4  # the fp8 rounding shows ...
    assert torch.allclose(second, plain_second, rtol=0.05, atol=0.05)  # ... and stays small
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        K2Model(open_weights(tiny_src), kv_cache_dtype=torch.bfloat16)
