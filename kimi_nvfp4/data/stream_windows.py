"""Windows of a large SGLang dump folder in memory bounded independently of the folder's size.

`windows.split_windows` holds every request, the whole prefix tree and every window: fine for a few thousand
requests, not for a 10 GB dump folder. `stream_sample_windows` reads the folder once, request by request
(data/sources/sglang_dump.py reads one pickle at a time), and keeps only:

- **a bounded prefix cache** instead of the exact tree: a 64-bit hash of every `PREFIX_BLOCK`-token prefix
  boundary of the requests seen recently (two generations of at most `cache_blocks / 2` hashes; a hit moves a hash
  to the newer one, so what stays is what recurs: the system prompt and tool declarations every session repeats,
  the running session's history). A request's new tokens start at its longest cached boundary: like a server's
  radix cache of bounded size, which is what decides what the server computes anyway. Agent turns arrive close
  together, so turn k+1 finds turn k's prefix; a prefix evicted since is counted as new again (its window is a
  real served window, only not deduplicated against a much older one).
- **a bounded set of window hashes** (same two generations) to drop exact duplicate windows;
- **the windows picked**, per part: the `samples` full windows of smallest rank, rank = blake2b(seed, window),
  a bottom-k sample. It depends on the set of windows and the seed, not on which file or order they came in.
- **counts** (requests, windows full and short, tokens, new tokens) and the 8-byte ids of the conversations.

Conversations and the held-out split are those of the in-memory path: the same `group_key` and the same
`sha256(seed:id)` threshold (`render.split_heldout`), decided per request with no state (the in-memory path's
"move one conversation over when a side is empty" needs every id: here an empty side is the usual DataError).
Held-out picks never equal a calibration pick (checked at the end, with spare picks to replace any), nor a
window the checkpoint's calibrate run recorded (data/window_pick.py).
"""

from __future__ import annotations

import hashlib
import heapq
from dataclasses import dataclass, field
from typing import Iterable, Iterator

import numpy as np
import torch

from .errors import DataError
from .render import MIN_TAIL_WINDOW_TOKENS, _split_key
from .source_registry import LoadResult
from .tokenizer import KimiTokenizer
from .traffic import TrafficRequest, completion_ids, group_key, prompt_ids
from .window_pick import window_hash

PREFIX_BLOCK = 16  # tokens per cached prefix boundary: new tokens are found to within this many
DEFAULT_CACHE_BLOCKS = 1 << 20  # ~16M tokens of recent distinct prefixes, ~100 MB of Python ints at most
DEFAULT_SEEN_WINDOWS = 1 << 20
_HASH_SEED = 0x6B696D69  # fixed: the prefix hashes must agree between runs


class _Generations:
    """A set of at most ~`cap` ints that forgets the least recently used first (two generations)."""

    def __init__(self, cap: int):
        self.half = max(1, cap // 2)
        self.new: set[int] = set()
        self.old: set[int] = set()

    def __contains__(self, key: int) -> bool:
        if key in self.new:
            return True
        if key in self.old:
            self.add(key)  # recently used again: keep it
            return True
        return False

    def add(self, key: int) -> None:
        self.new.add(key)
        if len(self.new) >= self.half:
            self.old, self.new = self.new, set()

    def __len__(self) -> int:
        return len(self.new) + len(self.old)


class _PositionWeights:
    """Random odd 64-bit weights per position: hash(prefix[:n]) = sum(ids * w)[:n] mod 2**64, vectorised."""

    def __init__(self) -> None:
        self._w = np.zeros(0, dtype=np.uint64)

    def __call__(self, n: int) -> np.ndarray:
        if n > len(self._w):
            size = max(n, 2 * len(self._w), 4096)
            rng = np.random.Generator(np.random.PCG64(_HASH_SEED))
            self._w = rng.integers(0, 2**63, size=size, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
        return self._w[:n]


@dataclass
class PartWindows:
    """What one part kept: its picks (bottom-k by rank) and counts."""

    picks: list[tuple[int, str, np.ndarray]] = field(default_factory=list)  # max-heap on rank via (-rank, ...)
    full: int = 0
    short: int = 0
    tokens: int = 0
    requests: int = 0
    conversations: set[int] = field(default_factory=set)


@dataclass
class StreamedWindows:
    calibration: PartWindows
    heldout: PartWindows
    rendered_tokens: int
    new_tokens: int
    excluded: int  # held-out windows left out as recorded calibration windows
    cache_entries: int  # prefix-cache size at the end (bounded by cache_blocks)

    @property
    def unique_token_fraction(self) -> float:
        return self.new_tokens / self.rendered_tokens if self.rendered_tokens else 0.0

    def sequences(self, part: str, samples: int) -> list[torch.Tensor]:
        """The part's picks, smallest rank first, held-out without any calibration pick."""
        chosen = self.calibration if part == "calibration" else self.heldout
        taken = {h for _, h, _ in self.calibration.picks} if part == "heldout" else set()
        ranked = sorted(chosen.picks, key=lambda p: -p[0])
        return [torch.from_numpy(w.copy()) for _, h, w in ranked if h not in taken][:samples]


class StreamWindower:
    """Feed served requests in arrival order (`add`); read the picks from `result()`."""

    def __init__(self, tokenizer: KimiTokenizer, seq_len: int, samples: int, seed: int, *, heldout_fraction: float,
                 split_seed: int = 0, vocab_size: int | None = None, exclude: frozenset[str] = frozenset(),
                 cache_blocks: int = DEFAULT_CACHE_BLOCKS, seen_windows: int = DEFAULT_SEEN_WINDOWS):
        self.tokenizer, self.seq_len, self.seed = tokenizer, seq_len, seed
        self.heldout_fraction, self.split_seed, self.vocab_size = heldout_fraction, split_seed, vocab_size
        self.keep = {"calibration": samples, "heldout": 2 * samples}  # spares replace held-out = calibration picks
        self.exclude = exclude
        self.cache = _Generations(cache_blocks)
        self.seen = _Generations(seen_windows)
        self.weights = _PositionWeights()
        self.parts = {"calibration": PartWindows(), "heldout": PartWindows()}
        self.rendered = self.new = self.excluded = 0
        self._seed = seed.to_bytes(8, "little", signed=True)

    def _new_from(self, seq: np.ndarray) -> int:
        n = len(seq) // PREFIX_BLOCK * PREFIX_BLOCK
        if n == 0:
            return 0
        with np.errstate(over="ignore"):
            sums = np.cumsum(seq[:n].astype(np.uint64) * self.weights(n), dtype=np.uint64)
        boundaries = [int(h) for h in sums[PREFIX_BLOCK - 1::PREFIX_BLOCK]]
        matched = 0
        for k, h in enumerate(boundaries):  # a sequence's boundaries are cached together: stop at the first miss
            if h not in self.cache:
                break
            matched = (k + 1) * PREFIX_BLOCK
        for h in boundaries[matched // PREFIX_BLOCK:]:
            self.cache.add(h)
        return matched

    def add(self, request: TrafficRequest) -> None:
        prompt, text = prompt_ids(request, self.tokenizer)
        key = group_key(prompt, self.tokenizer, request.session)
        seq = np.asarray(prompt + completion_ids(request, self.tokenizer, text), dtype=np.int64)
        if self.vocab_size is not None and len(seq) and (int(seq.max()) >= self.vocab_size or int(seq.min()) < 0):
            bad = int(seq.max()) if int(seq.max()) >= self.vocab_size else int(seq.min())
            raise DataError(f"token id {bad} lies outside this checkpoint's vocabulary of {self.vocab_size:,} (the data "
                            "was tokenized for another model; use data recorded from this model)",
                            record=request.where)
        name = "heldout" if _split_key(key, self.split_seed) < self.heldout_fraction else "calibration"
        part = self.parts[name]
        part.requests += 1
        part.conversations.add(int(key[2:18], 16) if len(key) >= 18 else hash(key))
        new_from = self._new_from(seq)
        self.rendered += len(seq)
        self.new += len(seq) - new_from
        end, ends = len(seq), []
        while end > new_from:
            ends.append(end)
            end -= self.seq_len
        for k, end in enumerate(ends):
            start = max(0, end - self.seq_len)
            if end - start < MIN_TAIL_WINDOW_TOKENS and len(ends) > 1 and k == len(ends) - 1:
                continue
            window = seq[start:end]
            if len(window) < 2:
                continue
            digest = window_hash(window)
            key_int = int(digest, 16)
            if key_int in self.seen:
                continue
            self.seen.add(key_int)
            if len(window) < self.seq_len:
                part.short += 1
                continue
            if name == "heldout" and digest in self.exclude:
                self.excluded += 1
                continue
            part.full += 1
            part.tokens += len(window)
            rank = int.from_bytes(hashlib.blake2b(self._seed + bytes.fromhex(digest), digest_size=8).digest(), "big")
            item = (-rank, digest, window.copy())
            if len(part.picks) < self.keep[name]:
                heapq.heappush(part.picks, item)
            elif -rank > part.picks[0][0]:
                heapq.heapreplace(part.picks, item)

    def result(self) -> StreamedWindows:
        return StreamedWindows(self.parts["calibration"], self.parts["heldout"], self.rendered, self.new,
                               self.excluded, len(self.cache))


def stream_dump_requests(spec_part: str, result: LoadResult) -> Iterator[TrafficRequest]:
    """The requests of one `sglang-dump:DIR[?outputs=false]` part, one at a time; skips are noted on `result`."""
    from dataclasses import replace

    from .source_registry import parse_part
    from .sources.sglang_dump import _entry, iter_dump

    source, body, options = parse_part(spec_part)
    if source.name != "sglang-dump":
        raise DataError(f"--data {spec_part!r}: only sglang-dump folders are windowed streaming")
    for where, entry in iter_dump(body, result):
        try:
            request = _entry(where, entry)
        except (ValueError, TypeError, AttributeError) as e:
            result.note_skip(f"{where}: {e}", "invalid request")
            continue
        yield request if options.outputs else replace(request, complete=False)


def stream_sample_windows(requests: Iterable[TrafficRequest], windower: StreamWindower) -> StreamedWindows:
    for request in requests:
        windower.add(request)
    return windower.result()
