"""What a stage (calibrate, validate) sees of a running layer.

An observer is any object with these methods (a `typing.Protocol`; `NullObserver` is a no-op base to
subclass). Tensors passed are views into the live computation: reduce them at once (amax, sums),
never keep references, never modify them.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class Observer(Protocol):
    # True: the MoE also runs EVERY token through EVERY routed expert, for statistics only (reported
    # through `on_linear(..., routed=False)`); the layer output is unchanged. Costs E/top_k times the
    # expert compute of a normal forward.
    route_all: bool

    def on_linear(
        self,
        layer: int,
        module: str,
        x: torch.Tensor,
        y: torch.Tensor,
        expert: int | None = None,
        routed: bool = True,
    ) -> None:
        """One linear ran. `module` is the checkpoint module name without prefix
        (`self_attn.q_a_proj`, `mlp.experts.3.gate_proj`, `mlp.shared_experts.up_proj`, `mlp.gate_proj`).
        `x [rows, in]` is the input BEFORE any activation quantization (what calibration must measure),
        `y [rows, out]` the output. For an expert, `x` holds only its routed tokens (or, with
        `routed=False`, all tokens of the chunk). The runner passes `routed` only when it is False."""

    def on_router(self, layer: int, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> None:
        """The router chose `topk_ids [T, k]` (long) with combine weights `topk_weights [T, k]`
        (normalised, times routed_scaling_factor), for one chunk of T tokens."""


@runtime_checkable
class ExpertRowsObserver(Protocol):
    """An observer that takes the routed experts' inputs of a chunk in one call, as the MoE's expert-sorted
    buffer, instead of one `on_linear` per expert and linear (model/moe.py's sorted path). Only observers that
    read no outputs (`needs_outputs = False`) are given it: the call carries inputs only."""

    def on_expert_rows(
        self, layer: int, rows: torch.Tensor, spans: list[tuple[int, int, int]], modules: list[tuple[str, ...]],
        n_experts: int,
    ) -> None:
        """Expert `spans[i][0]` read `rows[spans[i][1]:spans[i][2]]` (inputs before activation quantization)
        through the linears `modules[i]` (e.g. `("mlp.experts.3.gate_proj", "mlp.experts.3.up_proj")`); spans are
        in ascending expert order, each expert at most once; `n_experts` routed experts in the layer."""


def expert_rows_observer(observer: object) -> ExpertRowsObserver | None:
    """`observer` if the MoE may report its routed experts' inputs to it buffer by buffer, else None."""
    if isinstance(observer, ExpertRowsObserver) and not getattr(observer, "needs_outputs", True):
        return observer
    return None


class NullObserver:
    """Does nothing; subclass it and override what you need."""

    route_all: bool = False

    def on_linear(self, layer, module, x, y, expert=None, routed=True) -> None:
        pass

    def on_router(self, layer, topk_ids, topk_weights) -> None:
        pass


@runtime_checkable
class KVCacheObserver(Protocol):
    """An observer that also wants what the MLA cache holds (calibrate/kv_cache.py: FP8 KV-cache scales)."""

    def on_kv_cache(self, layer: int, latent: torch.Tensor, k_pe: torch.Tensor) -> None:
        """Layer `layer` wrote these tokens' cache rows: `latent [T, kv_lora_rank]` (after kv_a_layernorm)
        and `k_pe [T, qk_rope_head_dim]` (after rope): the two parts SGLang's MLA pool stores per token."""


def notify_kv_cache(observer: object, layer: int, latent: torch.Tensor, k_pe: torch.Tensor) -> None:
    # an optional second protocol: observers of linears only (validate) need not implement it
    if isinstance(observer, KVCacheObserver):
        observer.on_kv_cache(layer, latent, k_pe)


def notify_linear(
    observer: Observer | None, layer: int, module: str, x: torch.Tensor, y: torch.Tensor,
    expert: int | None = None, routed: bool = True,
) -> None:
    if observer is None:
        return
    if routed:
        observer.on_linear(layer, module, x, y, expert=expert)
    else:
        observer.on_linear(layer, module, x, y, expert=expert, routed=False)
