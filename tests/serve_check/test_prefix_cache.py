import pytest

from kimi_nvfp4.serve_check.prefix_cache import PrefixCache

from .conftest import TokenListKV


def _kv(tokens):
    return TokenListKV(list(tokens))


def test_longest_prefix_match_returns_truncated_private_copy():
    cache = PrefixCache(1000)
    cache.insert([1, 2, 3, 4, 5], _kv([1, 2, 3, 4, 5]))
    n, snap = cache.match([1, 2, 3, 9])
    assert n == 3 and snap.tokens == [1, 2, 3]
    n, snap2 = cache.match([1, 2, 3, 4, 5, 6])
    assert n == 5 and snap2.tokens == [1, 2, 3, 4, 5]
    snap2.truncate(1)  # the caller owns its copy
    assert cache.match([1, 2, 3, 4, 5])[1].tokens == [1, 2, 3, 4, 5]
    assert cache.match([7, 8]) == (0, None)


def test_max_match_leaves_a_token_to_compute():
    cache = PrefixCache(100)
    cache.insert([1, 2, 3], _kv([1, 2, 3]))
    n, snap = cache.match([1, 2, 3], max_match=2)
    assert n == 2 and snap.seq_len == 2


def test_branching_sequences_split_edges():
    cache = PrefixCache(100)
    cache.insert([1, 2, 3, 4], _kv([1, 2, 3, 4]))
    cache.insert([1, 2, 7, 8, 9], _kv([1, 2, 7, 8, 9]))
    assert cache.match([1, 2, 7, 8, 0])[0] == 4
    assert cache.match([1, 2, 3, 4, 0])[0] == 4
    assert cache.match([1, 2, 5])[0] == 2
    assert len(cache) == 2 and cache.cached_tokens == 9


def test_lru_eviction_under_token_budget():
    cache = PrefixCache(10)
    cache.insert([1, 2, 3, 4], _kv([1, 2, 3, 4]))
    cache.insert([5, 6, 7, 8], _kv([5, 6, 7, 8]))
    cache.match([1, 2, 3, 4])  # refresh the first: the second is now least recently used
    cache.insert([9, 9, 9], _kv([9, 9, 9]))
    assert cache.cached_tokens == 7 and len(cache) == 2
    assert cache.match([5, 6, 7, 8]) == (0, None)
    assert cache.match([1, 2, 3, 4])[0] == 4


def test_eviction_keeps_shared_prefix_reachable():
    cache = PrefixCache(9)
    cache.insert([1, 2, 3, 4], _kv([1, 2, 3, 4]))
    cache.insert([1, 2, 5, 6, 7], _kv([1, 2, 5, 6, 7]))
    cache.insert([1, 2, 3], _kv([1, 2, 3]))  # evicts [1,2,3,4] (LRU), keeps the rest
    n, snap = cache.match([1, 2, 3, 4])
    assert n == 3 and snap.tokens == [1, 2, 3]
    n, snap = cache.match([1, 2, 5, 6, 7, 8])
    assert n == 5


def test_stats_and_errors():
    cache = PrefixCache(100)
    cache.insert([1, 2], _kv([1, 2]))
    cache.match([1, 2, 3, 4])
    assert cache.stats.hit_rate == pytest.approx(0.5)
    with pytest.raises(ValueError, match="snapshot holds"):
        cache.insert([1, 2, 3], _kv([1]))
    cache.insert(list(range(200)), _kv(range(200)))  # larger than the budget: not stored
    assert len(cache) == 1
