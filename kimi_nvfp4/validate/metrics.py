"""Streaming comparison metrics: relative error between two tensors, and per-token KL, top-1
agreement and perplexity between a reference and a test model's logits.

All accumulate over any number of chunks / sequences in float64 scalars, so a 512-session run
keeps only one float per token (for the KL percentile and histogram).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

KL_P99 = 0.99
KL_HISTOGRAM_BINS = 40


class RelativeError:
    """sum ||ref - test||^2 / sum ||ref||^2 over every chunk added (relative MSE).

    The sums stay fp64 tensors on the data's device until read, so adding a chunk never waits
    for the GPU.
    """

    def __init__(self) -> None:
        self._diff: torch.Tensor | float = 0.0
        self._ref: torch.Tensor | float = 0.0
        self.count = 0

    def add(self, ref: torch.Tensor, test: torch.Tensor) -> None:
        if ref.shape != test.shape:
            raise ValueError(f"shapes differ: {tuple(ref.shape)} vs {tuple(test.shape)}")
        r = ref.to(torch.float64)
        self._diff = self._diff + (r - test.to(device=r.device, dtype=torch.float64)).square().sum()
        self._ref = self._ref + r.square().sum()
        self.count += ref.numel()

    @property
    def sum_sq_diff(self) -> float:
        return float(self._diff)

    @property
    def sum_sq_ref(self) -> float:
        return float(self._ref)

    @property
    def rel_mse(self) -> float:
        if self.count == 0:
            return 0.0
        diff, ref = self.sum_sq_diff, self.sum_sq_ref
        if ref == 0.0:
            return 0.0 if diff == 0.0 else math.inf
        return diff / ref


def percentile(values: torch.Tensor, q: float) -> float:
    """Nearest-rank percentile (no interpolation; works for any length, unlike torch.quantile)."""
    if values.numel() == 0:
        return 0.0
    s = torch.sort(values.reshape(-1).to(torch.float64)).values
    rank = min(s.numel() - 1, max(0, math.ceil(q * s.numel()) - 1))
    return float(s[rank])


def stream_drift(ref, test, device: torch.device) -> RelativeError:
    """The relative MSE between two hidden-state streams (`HiddenStates`), on the compute device (host-resident states
    are copied per sequence: the CPU's fp64 arithmetic over 7 billion values per stream would take minutes per
    layer)."""
    acc = RelativeError()
    for a, b in zip(ref.sequences, test.sequences):
        acc.add(a.to(device, non_blocking=True), b.to(device, non_blocking=True))
    return acc


@dataclass
class TokenComparison:
    """Per-token KL(ref || test), top-1 agreement and both models' NLL of the next token."""

    kl_chunks: list[torch.Tensor] = field(default_factory=list)  # fp32 CPU, one value per position
    top1_agree: int = 0
    positions: int = 0
    nll_ref: float = 0.0
    nll_test: float = 0.0
    scored: int = 0  # positions that have a next token (perplexity)

    def add(self, ref_logits: torch.Tensor, test_logits: torch.Tensor, tokens: torch.Tensor | None = None) -> None:
        """One sequence: logits `[seq, vocab]` of both models; `tokens` `[seq]` for perplexity."""
        if ref_logits.shape != test_logits.shape:
            raise ValueError(f"logit shapes differ: {tuple(ref_logits.shape)} vs {tuple(test_logits.shape)}")
        lp_ref = torch.log_softmax(ref_logits.to(torch.float32), dim=-1)
        lp_test = torch.log_softmax(test_logits.to(torch.float32), dim=-1)
        kl = (lp_ref.exp() * (lp_ref - lp_test)).sum(dim=-1).clamp_min(0.0)
        self.kl_chunks.append(kl.cpu())
        self.top1_agree += int((lp_ref.argmax(dim=-1) == lp_test.argmax(dim=-1)).sum())
        self.positions += kl.numel()
        if tokens is not None and tokens.numel() > 1:
            nxt = tokens[1:].to(device=lp_ref.device, dtype=torch.long).unsqueeze(-1)
            self.nll_ref -= float(lp_ref[:-1].gather(-1, nxt).sum(dtype=torch.float64))
            self.nll_test -= float(lp_test[:-1].gather(-1, nxt).sum(dtype=torch.float64))
            self.scored += nxt.shape[0]

    @property
    def kl_values(self) -> torch.Tensor:
        return torch.cat(self.kl_chunks) if self.kl_chunks else torch.zeros(0)

    @property
    def kl_mean(self) -> float:
        v = self.kl_values
        return float(v.to(torch.float64).mean()) if v.numel() else 0.0

    @property
    def kl_p99(self) -> float:
        return percentile(self.kl_values, KL_P99)

    @property
    def kl_max(self) -> float:
        v = self.kl_values
        return float(v.max()) if v.numel() else 0.0

    @property
    def top1(self) -> float:
        return self.top1_agree / self.positions if self.positions else 1.0

    @property
    def ppl_ref(self) -> float:
        return math.exp(self.nll_ref / self.scored) if self.scored else 1.0

    @property
    def ppl_test(self) -> float:
        return math.exp(self.nll_test / self.scored) if self.scored else 1.0

    @property
    def ppl_ratio(self) -> float:
        return self.ppl_test / self.ppl_ref

    def kl_histogram(self, bins: int = KL_HISTOGRAM_BINS) -> tuple[list[float], list[int]]:
        """Log-spaced bin edges (from 1e-6 nats) and counts; values below the first edge go in bin 0."""
        v = self.kl_values.to(torch.float64)
        hi = max(float(v.max()) if v.numel() else 1.0, 1e-5)
        edges = torch.logspace(-6, math.log10(hi) + 1e-9, bins + 1, dtype=torch.float64)
        idx = torch.bucketize(v.clamp(min=float(edges[0]), max=float(edges[-1])), edges, right=True) - 1
        counts = torch.bincount(idx.clamp(0, bins - 1), minlength=bins)
        return edges.tolist(), [int(c) for c in counts]
