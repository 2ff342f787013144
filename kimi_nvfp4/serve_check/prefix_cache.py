"""A radix tree over token ids holding KV-cache snapshots: the reference server's prefix cache.

Like SGLang's RadixCache (srt/mem_cache/radix_cache.py) a request reuses the longest cached prefix
of its prompt and reports it as `cached_tokens`. Unlike SGLang it stores whole-sequence snapshots
(the emulator's KVCache is not paged), so a hit clones the snapshot below the matched node and
truncates it to the matched length. Bounded by a token budget (sum of snapshot lengths), LRU.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar


class Snapshot(Protocol):
    """What the cache needs from a KV cache: its length, a deep copy, and in-place truncation."""

    @property
    def seq_len(self) -> int: ...

    def clone(self) -> Snapshot: ...

    def truncate(self, n: int) -> None: ...


S = TypeVar("S", bound=Snapshot)


@dataclass(eq=False)
class _Node(Generic[S]):
    edge: tuple[int, ...] = ()
    parent: _Node | None = None
    children: dict[int, _Node] = field(default_factory=dict)
    snapshot_key: int | None = None  # a key into PrefixCache._snapshots when a sequence ends here


@dataclass
class CacheStats:
    lookups: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class PrefixCache(Generic[S]):
    """Invariant: every leaf holds a snapshot, so any matched node has a snapshot somewhere below it."""

    def __init__(self, max_tokens: int):
        if max_tokens < 0:
            raise ValueError(f"prefix cache budget must be >= 0 tokens, got {max_tokens}")
        self.max_tokens = max_tokens
        self._root: _Node = _Node()
        self._snapshots: OrderedDict[int, tuple[_Node, S]] = OrderedDict()  # LRU order, oldest first
        self._keys = itertools.count()
        self.cached_tokens = 0
        self.stats = CacheStats()

    def __len__(self) -> int:
        return len(self._snapshots)

    def _walk(self, tokens: Sequence[int]) -> tuple[_Node, int]:
        """Deepest node whose path shares a prefix with `tokens`, and the number of tokens matched."""
        node, matched = self._root, 0
        while matched < len(tokens):
            child = node.children.get(tokens[matched])
            if child is None:
                break
            k = 0
            while k < len(child.edge) and matched + k < len(tokens) and child.edge[k] == tokens[matched + k]:
                k += 1
            matched += k
            node = child
            if k < len(child.edge):
                break
        return node, matched

    def match(self, tokens: Sequence[int], max_match: int | None = None) -> tuple[int, S | None]:
        """(matched length, a private snapshot truncated to it) for the longest cached prefix of `tokens`."""
        limit = len(tokens) if max_match is None else min(max_match, len(tokens))
        node, matched = self._walk(tokens[:limit])
        self.stats.lookups += 1
        self.stats.prompt_tokens += len(tokens)
        if matched == 0:
            return 0, None
        while node.snapshot_key is None:  # descend to any snapshot; a leaf always has one
            node = next(iter(node.children.values()))
        key = node.snapshot_key
        self._snapshots.move_to_end(key)
        snap = self._snapshots[key][1].clone()
        snap.truncate(matched)
        self.stats.hit_tokens += matched
        return matched, snap

    def insert(self, tokens: Sequence[int], snapshot: S) -> None:
        """Store `snapshot` (owned by the cache from now on) for `tokens`; evict LRU beyond the budget."""
        tokens = tuple(tokens)
        if snapshot.seq_len != len(tokens):
            raise ValueError(f"snapshot holds {snapshot.seq_len} tokens, key has {len(tokens)}")
        if not tokens or len(tokens) > self.max_tokens:
            return
        node = self._root
        i = 0
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                new = _Node(edge=tokens[i:], parent=node)
                node.children[tokens[i]] = new
                node, i = new, len(tokens)
                break
            k = 0
            while k < len(child.edge) and i + k < len(tokens) and child.edge[k] == tokens[i + k]:
                k += 1
            if k < len(child.edge):  # split the edge at k
                mid = _Node(edge=child.edge[:k], parent=node)
                node.children[tokens[i]] = mid
                child.edge = child.edge[k:]
                child.parent = mid
                mid.children[child.edge[0]] = child
                child = mid
            node, i = child, i + k
        if node.snapshot_key is not None:  # same sequence again: refresh it
            old = self._snapshots.pop(node.snapshot_key)
            self.cached_tokens -= old[1].seq_len
        key = next(self._keys)
        node.snapshot_key = key
        self._snapshots[key] = (node, snapshot)
        self.cached_tokens += len(tokens)
        self._evict()

    def _evict(self) -> None:
        while self.cached_tokens > self.max_tokens and self._snapshots:
            key, (node, snap) = self._snapshots.popitem(last=False)
            self.cached_tokens -= snap.seq_len
            node.snapshot_key = None
            self._prune(node)

    def _prune(self, node: _Node) -> None:
        """Drop snapshot-less leaves upwards and merge single-child nodes, keeping the invariant."""
        while node is not self._root and node.snapshot_key is None and not node.children:
            parent = node.parent
            del parent.children[node.edge[0]]
            node = parent
        if node is not self._root and node.snapshot_key is None and len(node.children) == 1:
            (only,) = node.children.values()
            only.edge = node.edge + only.edge
            only.parent = node.parent
            node.parent.children[node.edge[0]] = only

    def clear(self) -> None:
        self._root = _Node()
        self._snapshots.clear()
        self.cached_tokens = 0
