"""Host-resident hidden states: their PCIe transfers overlapped with the compute (LayerStreamRunner).

Why: when the memory plan keeps the hidden states in pinned host memory (they do not fit beside a layer on the
GPU), every attention sequence and every MLP/MoE chunk goes to the GPU and comes back, per stream and layer. Made
on the compute stream with a synchronous write-back, those copies stall it: validate at 512 x 2048 tokens took
46-57 s per MoE layer with host states against 28-32 s with states on the GPU. Here, with two copy streams:
- item i+1 is uploaded on the H2D stream while item i computes (double buffering);
- item i's result goes back into pinned memory on the D2H stream once its compute is done, while item i+1 computes
  (PCIe is full duplex: uploads and downloads overlap each other too).
The kernels, their inputs and their order on the compute stream are what they were: results are bit-identical.

Stream rules (what keeps it correct):
- an upload is allocated and written on the H2D stream; the compute stream waits for its event before the caller
  gets it, and the buffer is `record_stream`ed on the compute stream, so the caching allocator does not hand its
  memory to the H2D stream again before the compute is done with it;
- a download first makes the D2H stream wait for the compute stream (everything queued so far, the result
  included), then copies; the GPU source is `record_stream`ed on the D2H stream for the same reason;
- host memory: PyTorch records an event on the copying stream for every non-blocking copy to or from a pinned block,
  and its caching host allocator does not reuse a freed block before that event completes;
- `finish()` waits for both copy streams: the runner calls it before `attend` / `feed_forward` return, so the CPU
  may read the states (resume snapshots, validate's drift, logits) as soon as a method returns, and the next pass
  never reads host memory that a download is still writing;
- at most MAX_ITEMS_IN_FLIGHT items whose download (or compute) has not finished: the CPU then waits, so GPU memory
  held by buffers waiting on another stream stays bounded (HOST_TRANSFER_CHUNK_BUFFERS chunk-sized buffers beyond
  a synchronous loop's one: the previous input still computing, the next input, the previous output downloading).

Pinned allocation: `torch.empty(pin_memory=True)` goes through PyTorch's caching host allocator, so the attention
outputs of layer L+1 reuse the pinned blocks of layer L's inputs freed meanwhile; cudaHostAlloc runs for the first
layer only.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator, Sequence

import torch

MAX_ITEMS_IN_FLIGHT = 1  # items queued beyond the one the CPU is queueing, before it waits (see the docstring)
HOST_TRANSFER_CHUNK_BUFFERS = 3  # extra GPU buffers of one chunk's input size (stage_kit/memory_estimate.py)


class HostTransfers:
    """The copy streams of one runner whose hidden states live in pinned host memory while it computes on `device`."""

    def __init__(self, device: torch.device):
        self.device = device
        self.upload_stream = torch.cuda.Stream(device)
        self.download_stream = torch.cuda.Stream(device)
        self._in_flight: deque[torch.cuda.Event] = deque()

    def _compute_stream(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def _upload(self, pieces: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.cuda.Event]:
        with torch.cuda.stream(self.upload_stream):
            if len(pieces) == 1:
                x = pieces[0].to(self.device, non_blocking=True)
            else:  # what torch.cat of the pieces' copies gives, without the per-piece temporaries
                rows = sum(p.shape[0] for p in pieces)
                x = torch.empty((rows, *pieces[0].shape[1:]), dtype=pieces[0].dtype, device=self.device)
                offset = 0
                for p in pieces:
                    x[offset : offset + p.shape[0]].copy_(p, non_blocking=True)
                    offset += p.shape[0]
            event = self.upload_stream.record_event()
        return x, event

    def uploads(self, items: Iterable[Sequence[torch.Tensor]]) -> Iterator[torch.Tensor]:
        """Each item's host pieces as one tensor on the device (rows concatenated), ready for the compute stream.

        Item i+1's upload is queued before item i is handed over, so it runs beside item i's compute. The caller
        queues its work on the current stream (and its `download`s) before taking the next item.
        """
        compute = self._compute_stream()
        items = iter(items)
        first = next(items, None)
        pending = None if first is None else self._upload(first)
        while pending is not None:
            x, ready = pending
            following = next(items, None)
            pending = None if following is None else self._upload(following)
            compute.wait_event(ready)
            if x.numel():
                x.record_stream(compute)
            yield x
            del x
            # the item is queued: done when its compute and every download queued so far are
            self.download_stream.wait_stream(compute)
            self._in_flight.append(self.download_stream.record_event())
            while len(self._in_flight) > MAX_ITEMS_IN_FLIGHT:
                self._in_flight.popleft().synchronize()

    def download(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Copy each GPU `src` (computed on the current stream) into its pinned host `dst`, on the D2H stream."""
        self.download_stream.wait_stream(self._compute_stream())
        with torch.cuda.stream(self.download_stream):
            for src, dst in pairs:
                dst.copy_(src, non_blocking=True)
        for src, _dst in pairs:
            if src.numel():
                src.record_stream(self.download_stream)

    def download_new(self, src: torch.Tensor) -> torch.Tensor:
        """`src` copied into a new pinned host tensor (complete after `finish()`)."""
        host = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
        self.download([(src, host)])
        return host

    def finish(self) -> None:
        """Wait for every transfer queued so far (the host states are then safe to read and to write)."""
        self.download_stream.synchronize()
        self.upload_stream.synchronize()
        self._in_flight.clear()


__all__ = ["HOST_TRANSFER_CHUNK_BUFFERS", "MAX_ITEMS_IN_FLIGHT", "HostTransfers"]
