"""Run the model one decoder layer at a time over many sequences (calibrate, validate).

Memory: one layer's weights (experts kept compressed, dequantized one expert at a time) plus every
sequence's hidden states `[seq_len, hidden]` -- on the compute device, or on `states_device` (e.g.
"cpu" while computing on "cuda") when they do not fit; host states are kept pinned and copied on copy streams
beside the compute (host_states.py). Token-wise work (MLP/MoE, lm_head) runs on
chunks of at most `max_chunk_tokens` tokens; attention runs per sequence with its score matrix
blocked to `attention.ATTENTION_SCORE_BUDGET`.

A layer is `attend` (per sequence, returns the post-attention residual) then `feed_forward` (token
chunks across sequences, in place); `apply_layer` = load + both. Calibration calls the halves itself
so that one loaded layer and one attention serve both its W4A16 observe and W4A4 advance passes.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from .attention import rms_norm
from .decoder import attention_block, mlp_block
from .host_states import HostTransfers
from .batch_invariant import linear_rows
from .layer_weights import LayerWeights
from .observer import Observer
from .rope import RotaryEmbedding
from .weights import WeightSource

# MoE/lm_head work per chunk: ~4 x tokens x hidden floats (1.9 GB at 16k K2.6 tokens in fp32), up to
# CHUNK_BYTES_PER_VALUE bytes per value in W4A4. Larger chunks mean fewer dequantizations of each expert
# (once per chunk unless `materialize_layers`) and fewer, larger per-expert matmuls.
DEFAULT_MAX_CHUNK_TOKENS = 16384
# Tokens per MLP/MoE chunk on CUDA (calibrate, validate): 4x the default, so each of K2.6's 384 experts
# gets ~1.4k rows per matmul instead of ~340 and per-chunk fixed costs (routing, the sorted gather, kernel
# launches per expert) happen 4x less often. Working memory: `LayerStreamRunner.chunk_bytes`.
CUDA_MAX_CHUNK_TOKENS = 65536
AUTO = "auto"
# Peak bytes per (token x hidden) value of one W4A4 MoE chunk, counted from the ops: the gathered chunk,
# its norm and its quantized copy in the compute dtype, the fp32 routed sum (~4 x 4 B in fp32), plus
# fake_quantize_activation_nvfp4's temporaries (fp32 copy, scaled blocks, |x|, codes, int32 index,
# decoded values: ~14-16 B). Rounded up; used only to decide `materialize_layers="auto"`.
CHUNK_BYTES_PER_VALUE = 40
# The expert-sorted MoE path (moe.py) also holds, per (token, slot) pair, the gathered input, its
# quantized copy and the expert output: SORTED_BUFFERS_PER_PAIR rows of `hidden` values in the compute dtype.
SORTED_BUFFERS_PER_PAIR = 3
# Kept free besides a chunk's work when deciding to materialize: attention score blocks
# (ATTENTION_SCORE_BUDGET fp32 = 1 GiB), allocator fragmentation, the CUDA context's later needs.
MATERIALIZE_HEADROOM_BYTES = 4 * 2**30


def layer_tensors(obj, seen: set[int] | None = None) -> Iterator[torch.Tensor]:
    """Every tensor a loaded layer holds (through its dataclasses, linears, lists), each once."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from layer_tensors(x, seen)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from layer_tensors(x, seen)
    elif hasattr(obj, "__dict__") and not isinstance(obj, type):
        for x in vars(obj).values():
            yield from layer_tensors(x, seen)


def layer_stored_bytes(w: LayerWeights) -> int:
    """Bytes a loaded layer's linears hold as stored (packed codes, scales, dense weights)."""
    return sum(lin.stored_bytes() for lin in w.linears())


@dataclass
class HiddenStates:
    """Each sequence's residual stream `[seq_len, hidden]`, in input order."""

    sequences: list[torch.Tensor]

    def __len__(self) -> int:
        return len(self.sequences)

    @property
    def lengths(self) -> list[int]:
        return [s.shape[0] for s in self.sequences]

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths)


def token_chunks(lengths: Sequence[int], max_tokens: int | None) -> Iterator[list[tuple[int, int, int]]]:
    """Cover every (sequence, position) once, in order, with chunks of at most `max_tokens` tokens.

    Each chunk is a list of `(sequence index, start, end)` pieces.
    """
    budget = max_tokens or max(1, sum(lengths))
    chunk: list[tuple[int, int, int]] = []
    room = budget
    for si, n in enumerate(lengths):
        start = 0
        while start < n:
            take = min(room, n - start)
            chunk.append((si, start, start + take))
            start += take
            room -= take
            if room == 0:
                yield chunk
                chunk, room = [], budget
    if chunk:
        yield chunk


_LIVE_RUNNERS: "weakref.WeakSet[LayerStreamRunner]" = weakref.WeakSet()  # runners with a prefetch thread


def close_prefetch_threads() -> None:
    """Join the prefetch thread of every runner that started one (distributed.shutdown, before the group goes)."""
    for runner in list(_LIVE_RUNNERS):
        runner.close()


class LayerStreamRunner:
    def __init__(
        self,
        source: WeightSource,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        max_chunk_tokens: int | None = DEFAULT_MAX_CHUNK_TOKENS,
        states_device: torch.device | str | None = None,
        progress: bool = True,
        materialize_layers: bool | str = False,
        prefetch: bool = False,
    ):
        self.source = source
        self.config = source.config
        self.device = torch.device(device)
        self.dtype = dtype
        self.max_chunk_tokens = max_chunk_tokens
        self.states_device = torch.device(states_device) if states_device is not None else self.device
        self.progress = progress
        # dequantize every linear once per layer (32 bits/weight: 68 GB for a K2.6 layer in fp32, 34 GB in
        # bf16) instead of once per expert per chunk; worth it when the device has the room. "auto": on
        # CUDA, when the layer fits the free memory at its first feed_forward (else per chunk)
        if materialize_layers not in (True, False, AUTO):
            raise ValueError(f"materialize_layers must be True, False or {AUTO!r}, got {materialize_layers!r}")
        self.materialize_layers = materialize_layers
        # `apply_layer(i)` starts loading layer i+1 in a background thread (two layers resident)
        self.prefetch_next = prefetch
        self.rope = RotaryEmbedding.from_config(self.config)
        self._loader: ThreadPoolExecutor | None = None
        self._load_stream: torch.cuda.Stream | None = None
        self._pending: tuple[int, Future] | None = None
        self._head: tuple[torch.Tensor, torch.Tensor] | None = None
        self._host: HostTransfers | None = None  # copy streams, made at the first transfer of host states

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    def embed(self, sequences: Sequence[torch.Tensor]) -> HiddenStates:
        table = self.source.embed("cpu")
        out = []
        for i, ids in enumerate(sequences):
            ids = torch.as_tensor(ids, dtype=torch.long).reshape(-1).cpu()
            if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= table.shape[0]):
                raise ValueError(f"sequence {i}: token ids must lie in [0, {table.shape[0]})")
            out.append(self._to_states(table[ids].to(self.dtype)))
        return HiddenStates(out)

    @property
    def states_on_host(self) -> bool:
        """Whether the hidden states live in host memory while the compute runs on a GPU (the memory plan's
        choice when they do not fit beside a layer): then they are kept in pinned memory, so each copy is one DMA
        transfer instead of a staged one."""
        return self.states_device.type == "cpu" and self.device.type == "cuda"

    def _to_states(self, t: torch.Tensor) -> torch.Tensor:
        if not self.states_on_host:
            return t.to(self.states_device)
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t)  # synchronous: the CPU may read the states (snapshots) as soon as this returns
        # (attend and feed_forward copy host states on their own streams instead: host_states.py)
        return host

    def _load(self, i: int) -> LayerWeights:
        if self.device.type != "cuda":
            w = self.source.layer(i, self.device, self.dtype)
            if self.materialize_layers is True:
                w.materialize()
            return w
        # On its own CUDA stream, so that a prefetch's uploads and conversions overlap the compute the
        # main thread queues on the default stream instead of queueing behind it (and it behind them).
        if self._load_stream is None:
            self._load_stream = torch.cuda.Stream(self.device)
        with torch.cuda.stream(self._load_stream):
            w = self.source.layer(i, self.device, self.dtype)
            if self.materialize_layers is True:
                w.materialize()
        self._load_stream.synchronize()
        consumer = torch.cuda.default_stream(self.device)
        for t in layer_tensors(w):
            # made on the load stream, used and freed on the default stream: the caching allocator must
            # not hand their memory to the load stream again before the default stream is done with it
            t.record_stream(consumer)
        return w

    def prefetch(self, i: int) -> None:
        """Start loading layer i in a background thread; the next `load_layer(i)` picks it up."""
        if not 0 <= i < self.num_layers or (self._pending is not None and self._pending[0] == i):
            return
        if self._loader is None:
            self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="layer-prefetch")
            _LIVE_RUNNERS.add(self)
        self._pending = (i, self._loader.submit(self._load, i))

    def close(self) -> None:
        """Wait for a prefetch in flight and join the prefetch thread (idempotent). distributed.shutdown calls it for
        every runner before the process group goes: a thread still inside a collective-backed load at exit aborts."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending[1].result()
        if self._loader is not None:
            self._loader.shutdown(wait=True)
            self._loader = None
        _LIVE_RUNNERS.discard(self)

    def _take(self, i: int) -> LayerWeights:
        pending, self._pending = self._pending, None
        if pending is not None and pending[0] == i:
            return pending[1].result()
        if pending is not None:
            pending[1].result()  # finish (and drop) a prefetch nobody asked for
        return self._load(i)

    def load_layer(self, i: int) -> LayerWeights:
        """Layer i's weights (the prefetched copy if there is one); starts prefetching i+1 if enabled."""
        w = self._take(i)
        if self.prefetch_next:
            self.prefetch(i + 1)
        return w

    def attend(self, i: int, states: HiddenStates, w: LayerWeights, observer: Observer | None = None) -> HiddenStates:
        """`x + attn(norm(x))` for every sequence: the post-attention residual, as new tensors
        (`states` is left as it was)."""
        if w.index != i:
            raise ValueError(f"weights of layer {w.index} passed for layer {i}")
        if self.states_on_host:  # uploads and downloads beside the compute (host_states.py)
            copies = self._host_transfers()
            out = [copies.download_new(attention_block(self.config, self.rope, w, x, observer=observer)[0])
                   for x in copies.uploads([x] for x in states.sequences)]
            copies.finish()  # the CPU may read the states (snapshots) as soon as this returns
            return HiddenStates(out)
        out = []
        for x in states.sequences:
            h, _ = attention_block(self.config, self.rope, w, x.to(self.device, non_blocking=True), observer=observer)
            out.append(self._to_states(h))
        return HiddenStates(out)

    def feed_forward(
        self, states: HiddenStates, w: LayerWeights, observer: Observer | None = None, *, output: bool = True
    ) -> HiddenStates | None:
        """`h + mlp(norm(h))` on chunks of tokens across sequences, written back INTO `states` (returned).

        `output=False`: a statistics-only pass for `observer` -- `states` is not modified and the work
        only the output needs is skipped (moe.py); returns None.
        """
        self._auto_materialize(w, states.num_tokens)
        if self.states_on_host:
            return self._feed_forward_host(states, w, observer, output)
        for chunk in token_chunks(states.lengths, self.max_chunk_tokens):
            x = torch.cat([states.sequences[si][a:b].to(self.device, non_blocking=True) for si, a, b in chunk])
            y = mlp_block(self.config, w, x, observer=observer, need_output=output)
            if not output:
                continue
            offset = 0
            for si, a, b in chunk:
                states.sequences[si][a:b] = y[offset : offset + b - a]
                offset += b - a
        return states if output else None

    def _feed_forward_host(self, states: HiddenStates, w: LayerWeights, observer: Observer | None,
                           output: bool) -> HiddenStates | None:
        """`feed_forward` with host-resident states: chunk i+1 uploads and chunk i-1 downloads while chunk i
        computes (host_states.py); the same chunks and kernels, so the same results."""
        copies = self._host_transfers()
        chunks = list(token_chunks(states.lengths, self.max_chunk_tokens))
        pieces = ([states.sequences[si][a:b] for si, a, b in chunk] for chunk in chunks)
        for i, x in enumerate(copies.uploads(pieces)):
            chunk = chunks[i]
            y = mlp_block(self.config, w, x, observer=observer, need_output=output)
            del x
            if not output:
                continue
            pairs, offset = [], 0
            for si, a, b in chunk:
                pairs.append((y[offset : offset + b - a], states.sequences[si][a:b]))
                offset += b - a
            copies.download(pairs)
            del y, pairs
        copies.finish()  # every chunk is back in `states` before the CPU may read them
        return states if output else None

    def _host_transfers(self) -> HostTransfers:
        if self._host is None:
            self._host = HostTransfers(self.device)
        return self._host

    def apply_layer(self, i: int, states: HiddenStates, observer: Observer | None = None) -> HiddenStates:
        """Load layer i (or take the prefetched one), run every sequence through it, free it."""
        w = self.load_layer(i)
        out = self.feed_forward(self.attend(i, states, w, observer), w, observer)
        del w
        return out

    # --- materialize_layers="auto" ------------------------------------------------------------
    def chunk_bytes(self, num_tokens: int) -> int:
        """Rough peak working memory of one MLP/MoE chunk over `num_tokens` tokens in all: input, norm,
        fp32 routed sum, the W4A4 quantization's temporaries (CHUNK_BYTES_PER_VALUE per value)."""
        tokens = min(self.max_chunk_tokens or num_tokens, num_tokens)
        pairs = SORTED_BUFFERS_PER_PAIR * self.config.num_experts_per_tok * self.dtype.itemsize
        return (CHUNK_BYTES_PER_VALUE + pairs) * tokens * self.config.hidden_size

    def materialize_fits(self, w: LayerWeights, num_tokens: int, free_bytes: int) -> bool:
        """Whether dequantizing `w` once leaves room for a chunk's work over `num_tokens` tokens, a
        prefetched layer if one is coming, and MATERIALIZE_HEADROOM_BYTES, within `free_bytes`."""
        need = sum(lin.dequantized_bytes() for lin in w.linears())
        headroom = self.chunk_bytes(num_tokens) + MATERIALIZE_HEADROOM_BYTES
        if self._pending is not None:
            headroom += layer_stored_bytes(w)
        return need + headroom <= free_bytes

    def _auto_materialize(self, w: LayerWeights, num_tokens: int) -> None:
        """`materialize_layers="auto"`: on CUDA, dequantize the layer once if it fits the free memory
        now (after attention, with the layer input freed); else keep dequantizing per chunk."""
        if self.materialize_layers != AUTO or self.device.type != "cuda":
            return
        free, _total = torch.cuda.mem_get_info(self.device)
        # blocks the caching allocator holds but does not use are free for our tensors too
        free += torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
        if self.materialize_fits(w, num_tokens, free):
            w.materialize()

    def logits(self, states: HiddenStates) -> Iterator[torch.Tensor]:
        """Per sequence, `[seq_len, vocab]` logits on the compute device (final norm, then lm_head). One copy of
        the head per runner however many streams take logits at once (2.2 GiB at K2.6's vocabulary in bf16)."""
        if self._head is None:
            self._head = (self.source.final_norm(self.device), self.source.lm_head(self.device).to(self.dtype))
        norm, head = self._head
        step = self.max_chunk_tokens or None
        for x in states.sequences:
            parts = []
            for start in range(0, x.shape[0], step or max(1, x.shape[0])):
                piece = x[start : start + step if step else None].to(self.device)
                parts.append(linear_rows(rms_norm(piece, norm, self.config.rms_norm_eps), head))
            yield torch.cat(parts) if parts else x.new_zeros(0, head.shape[0], device=self.device)

    def run(self, sequences: Sequence[torch.Tensor], observer: Observer | None = None) -> Iterator[torch.Tensor]:
        """Embed, every layer in turn, then yield each sequence's logits."""
        states = self.embed(sequences)
        for i in tqdm(range(self.num_layers), desc="layers", disable=not self.progress):
            states = self.apply_layer(i, states, observer)
        yield from self.logits(states)
