"""The layer progress bar of the model stages: layers done / total, and tokens per second of the whole job.

Every rank of a torch.distributed run streams the same layer over its share of the tokens, in step with the others,
so the job's rate is all ranks' tokens over the layer's wall time; the bar is drawn on rank 0 only (the caller passes
`enabled=progress and ctx.is_main`).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from typing import TypeVar

from tqdm.auto import tqdm

from ..distributed import RankContext

T = TypeVar("T")

_clock = time.perf_counter  # module-level so that tests can drive it


def job_tokens(ctx: RankContext, local_tokens: int) -> int:
    """Tokens every rank streams through a layer together (this rank's when not distributed)."""
    return int(sum(ctx.all_gather_object(int(local_tokens))))


def format_rate(tokens_per_s: float) -> str:
    if tokens_per_s >= 1e6:
        return f"{tokens_per_s / 1e6:.2f}M tok/s"
    if tokens_per_s >= 1e3:
        return f"{tokens_per_s / 1e3:.1f}k tok/s"
    return f"{tokens_per_s:.0f} tok/s"


def layer_progress(layers: Iterable[T], *, tokens_per_layer: int, desc: str, enabled: bool,
                   done: int = 0) -> Iterator[T]:
    """Yield each layer; after its work the bar advances and shows the last layer's tokens per second.
    `done`: layers finished before these (a resumed run), counted in the bar's total and start."""
    items = list(layers)
    with tqdm(total=len(items) + done, initial=done, desc=desc, unit="layer", disable=not enabled) as bar:
        for item in items:
            start = _clock()
            yield item
            seconds = _clock() - start
            if seconds > 0 and tokens_per_layer:
                bar.set_postfix_str(format_rate(tokens_per_layer / seconds), refresh=False)
            bar.update(1)
