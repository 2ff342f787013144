"""Loaded sources -> the calibration and held-out windows of a run: the one path calibrate, validate, requantize,
`data stats` and `data export` take, so what `data export` writes is exactly what the stages use.

1. Conversations (sessions) are split by id before rendering; recorded requests are tokenized (as served, or
   rendered with the checkpoint's template: data/traffic.py) and grouped into conversations, then split the same
   way. The split is `render.split_heldout` with a fixed seed: by conversation, never by request.
2. Calibration windows are cut first; the held-out windows are cut after them through the same prefix tree with
   the calibration part reserved (`window_groups(exclude=...)`), so no held-out window equals a calibration
   window of the run and shared prefixes are counted once (the unique-token fraction reports how much repeats).
3. Every window is checked against the checkpoint's vocabulary before anything else runs (`check_vocabulary`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from .conversations import Conversation
from .errors import DataError
from .render import RenderedSessions, SessionRequests, served_requests, split_heldout, window_groups
from .source_registry import LoadResult
from .tokenizer import KimiTokenizer
from .traffic import RequestGroup, group_requests


@dataclass
class SplitWindows:
    """The windows of both parts (held-out rendered with the calibration part reserved)."""

    calibration: RenderedSessions
    heldout: RenderedSessions
    calibration_groups: int
    heldout_groups: int

    @property
    def unique_token_fraction(self) -> float:
        """Tokens a radix-cached server computes / tokens in every request: how little the traffic repeats."""
        rendered = self.calibration.stats.rendered_tokens + self.heldout.stats.rendered_tokens
        new = self.calibration.stats.new_tokens + self.heldout.stats.new_tokens
        return new / rendered if rendered else 0.0


def unique_conversations(results: Sequence[LoadResult]) -> list[Conversation]:
    seen: dict[str, Conversation] = {}
    for r in results:
        for c in r.conversations:
            seen.setdefault(c.id, c)
    return list(seen.values())


def split_windows(results: Sequence[LoadResult], tokenizer: KimiTokenizer, seq_len: int, *,
                  heldout_fraction: float, split_seed: int = 0, preserve_thinking: bool = False,
                  need_heldout: bool = True) -> SplitWindows:
    """The windows of every source in `results` (see the module docstring).

    :param need_heldout: False skips cutting the held-out part (calibrate needs only its own windows; the
        calibration windows do not depend on the held-out part).
    """
    convs = unique_conversations(results)
    conv_cal, conv_held = split_heldout(convs, heldout_fraction, split_seed) if convs else ([], [])
    traffic: list[RequestGroup] = group_requests((q for r in results for q in r.requests), tokenizer)
    traffic_cal, traffic_held = split_heldout(traffic, heldout_fraction, split_seed) if traffic else ([], [])

    def rendered(some: Sequence[Conversation]) -> list[SessionRequests]:
        return [SessionRequests(c.id, served_requests(c, tokenizer, preserve_thinking=preserve_thinking))
                for c in some]

    calibration_groups = [*rendered(conv_cal), *traffic_cal]
    calibration = window_groups(calibration_groups, seq_len)
    heldout_groups = [*rendered(conv_held), *traffic_held] if need_heldout else []
    heldout = window_groups(heldout_groups, seq_len, exclude=calibration_groups) if need_heldout \
        else window_groups([], seq_len)
    return SplitWindows(calibration, heldout, len(calibration_groups), len(conv_held) + len(traffic_held))


def checkpoint_vocab_size(checkpoint: str | Path) -> int | None:
    """`vocab_size` from the checkpoint's config.json (K2.5/K2.6 keep it under `text_config`), None without one."""
    path = Path(checkpoint) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    size = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    return int(size) if isinstance(size, int) else None


def check_vocabulary(sequences: Sequence[torch.Tensor], vocab_size: int, *, data: str, where: str) -> None:
    """DataError when a token id lies outside [0, vocab_size): the data was tokenized for another model."""
    if not sequences:
        return
    top = max(int(s.max()) for s in sequences if s.numel())
    low = min(int(s.min()) for s in sequences if s.numel())
    if top >= vocab_size or low < 0:
        bad = next(i for i, s in enumerate(sequences) if s.numel() and (int(s.max()) >= vocab_size or int(s.min()) < 0))
        raise DataError(
            f"--data {data!r}: token id {top if top >= vocab_size else low} in window {bad} of the {where} part lies "
            f"outside this checkpoint's vocabulary: the data was tokenized for a vocabulary of at least {top + 1:,}; "
            f"this checkpoint has {vocab_size:,} (use data recorded from this model, or its tokenizer)")
