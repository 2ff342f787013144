"""Sessions -> token sequences (with the checkpoint's chat template), and the held-out split.

Calibrate and validate both call `render_sessions`; calibrate uses only the calibration part of
`split_heldout` and validate only the held-out part, so validation never sees the text the
activation scales were fitted on.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

import torch

from .conversations import Conversation
from .tokenizer import KimiTokenizer

DEFAULT_HELDOUT_FRACTION = 0.2
# A split session's last window is dropped when shorter than this: a few tokens of a session's
# tail carry little signal and would add a near-empty sequence to every batch.
MIN_TAIL_WINDOW_TOKENS = 16


@dataclass
class TokenStats:
    """What rendering produced, for the calibrate/validate reports."""

    conversations: int = 0
    samples: int = 0  # sequences produced
    tokens: int = 0  # tokens in the produced sequences
    rendered_tokens: int = 0  # tokens of the full rendered sessions, before windowing
    split: int = 0  # sessions longer than seq_len cut into several windows
    truncated: int = 0  # sessions longer than seq_len cut to one window (split_long=False)
    dropped_tokens: int = 0  # tokens lost to truncation or dropped short tail windows
    max_session_tokens: int = 0
    session_lengths: list[int] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        lengths = d.pop("session_lengths")
        d["mean_session_tokens"] = (sum(lengths) / len(lengths)) if lengths else 0.0
        return d


@dataclass
class RenderedSessions:
    sequences: list[torch.Tensor]  # int64 [len] each
    stats: TokenStats
    conversation_ids: list[str]  # the conversation each sequence came from


def render_conversation(conv: Conversation, tokenizer: KimiTokenizer, **template_kwargs: Any) -> list[int]:
    """Token ids of one whole session, rendered by the chat template (specials allowed)."""
    return tokenizer.encode_chat(conv.messages, tools=conv.tools, add_generation_prompt=False, **template_kwargs)


def _windows(ids: list[int], seq_len: int) -> list[list[int]]:
    windows = [ids[i:i + seq_len] for i in range(0, len(ids), seq_len)]
    if len(windows) > 1 and len(windows[-1]) < MIN_TAIL_WINDOW_TOKENS:
        windows.pop()
    return windows


def render_sessions_with_stats(convs: Sequence[Conversation], tokenizer: KimiTokenizer, seq_len: int, *,
                               split_long: bool = True, **template_kwargs: Any) -> RenderedSessions:
    """Render, tokenize and cut every session into windows of at most `seq_len` tokens.

    split_long=True: a long session becomes consecutive windows (the tail dropped if shorter than
    MIN_TAIL_WINDOW_TOKENS); False: it is truncated to its first `seq_len` tokens.
    """
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    stats = TokenStats()
    sequences: list[torch.Tensor] = []
    ids_of: list[str] = []
    for conv in convs:
        ids = render_conversation(conv, tokenizer, **template_kwargs)
        stats.conversations += 1
        stats.rendered_tokens += len(ids)
        stats.session_lengths.append(len(ids))
        stats.max_session_tokens = max(stats.max_session_tokens, len(ids))
        if len(ids) <= seq_len:
            windows = [ids]
        elif split_long:
            windows = _windows(ids, seq_len)
            stats.split += 1
        else:
            windows = [ids[:seq_len]]
            stats.truncated += 1
        kept = sum(len(w) for w in windows)
        stats.dropped_tokens += len(ids) - kept
        for w in windows:
            if w:
                sequences.append(torch.tensor(w, dtype=torch.long))
                ids_of.append(conv.id)
    stats.samples = len(sequences)
    stats.tokens = sum(int(s.numel()) for s in sequences)
    return RenderedSessions(sequences, stats, ids_of)


def render_sessions(convs: Sequence[Conversation], tokenizer: KimiTokenizer, seq_len: int, *,
                    split_long: bool = True, **template_kwargs: Any) -> list[torch.Tensor]:
    """Token sequences (int64, each at most `seq_len` long) of the rendered sessions."""
    return render_sessions_with_stats(convs, tokenizer, seq_len, split_long=split_long, **template_kwargs).sequences


def _split_key(conv_id: str, seed: int) -> str:
    return hashlib.sha256(f"{seed}:{conv_id}".encode()).hexdigest()


def split_heldout(convs: Sequence[Conversation], heldout_fraction: float = DEFAULT_HELDOUT_FRACTION,
                  seed: int = 0) -> tuple[list[Conversation], list[Conversation]]:
    """(calibration, heldout): the `round(n * fraction)` sessions with the smallest sha256(seed:id) are held out.

    Depends only on the ids and the seed, so it is the same on every machine and in every stage;
    both parts keep the input order. With at least two sessions and 0 < fraction < 1, each part
    gets at least one. Sessions sharing an id (duplicates) always land on the same side.
    """
    if not 0.0 <= heldout_fraction <= 1.0:
        raise ValueError(f"heldout_fraction must be in [0, 1], got {heldout_fraction}")
    unique_ids = sorted({c.id for c in convs}, key=lambda i: _split_key(i, seed))
    n = len(unique_ids)
    count = round(n * heldout_fraction)
    if n >= 2 and 0.0 < heldout_fraction < 1.0:
        count = min(max(count, 1), n - 1)
    heldout_ids = set(unique_ids[:count])
    calibration = [c for c in convs if c.id not in heldout_ids]
    heldout = [c for c in convs if c.id in heldout_ids]
    return calibration, heldout
