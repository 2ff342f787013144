"""Sessions -> the token sequences a server computes for them, and the held-out split.

What calibrate and validate see is what a served model sees. A coding agent does not send a
session whole: it sends one request per assistant turn, and the server's radix cache computes only
what it has not computed before. So each session is rendered as its **served requests**
(`served_requests`): for assistant message i, the prompt is the chat template over messages[:i]
with the generation prompt (what the agent sends), and the completion is message i in Kimi's
output grammar, reasoning and tool calls included (what the model generated):

    <think>{reasoning}</think>{content}<|tool_calls_section_begin|><|tool_call_begin|>{id}
    <|tool_call_argument_begin|>{arguments}<|tool_call_end|>…<|tool_calls_section_end|>

minus whatever the generation prompt already holds (`<think>` when it opens thinking), minus the
final `<|im_end|>` (the stop token is produced, never fed back). With Kimi's real templates the
reasoning of finished turns is not in later prompts (history turns render `<think></think>`), so
reasoning is only seen where the model produced it, as in serving. `preserve_thinking=True` passes
K2.6's template variable that keeps every turn's reasoning in the prompts (clients that replay
reasoning, e.g. `chat_template_kwargs: {preserve_thinking: true}`); off by default, as SGLang
renders a request that does not ask for it.

Windows (`render_sessions_with_stats`): the requests of all sessions go through one prefix tree,
like the server's radix cache; a request's new tokens are those after its longest prefix already
seen (the shared tool declarations and system prompt are new once; a turn's new tool result and
completion are new each time). Windows of at most `seq_len` tokens end at the request's end and
step back until they cover its new tokens, so new tokens get up to `seq_len - 1` tokens of
context. A window never consists only of tokens computed before, and exact duplicates are dropped:
windows are distinct. With `exclude=`, the excluded sessions (the calibration part, when rendering
the held-out part) are put through the same tree first and their windows are reserved, so
held-out windows are disjoint from calibration windows: split by session first (`split_heldout`),
then rendered with the other part excluded.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, field
from typing import Any, Iterator, Protocol, Sequence

import numpy as np
import torch

from .conversations import Conversation, Message, Role
from .tokenizer import KimiTokenizer

DEFAULT_HELDOUT_FRACTION = 0.2
# A request's first (leftmost) window is dropped when shorter than this and others cover the
# request: a few tokens without context carry little signal and add a near-empty sequence.
MIN_TAIL_WINDOW_TOKENS = 16
# Kimi's output grammar (SPEC §1; kimi_k2 parsers).
THINK_BEGIN, THINK_END = "<think>", "</think>"
SECTION_BEGIN, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL_BEGIN, ARGUMENT_BEGIN, CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
# What a generation prompt may already have emitted of the completion (K2.5/K2.6 open thinking).
_PROMPT_OWNED_PREFIXES = (THINK_BEGIN + THINK_END, THINK_BEGIN)


@dataclass
class TokenStats:
    """What rendering produced, for the calibrate/validate reports."""

    conversations: int = 0
    requests: int = 0  # served requests (assistant turns)
    samples: int = 0  # windows produced
    tokens: int = 0  # tokens in the windows
    rendered_tokens: int = 0  # prompt + completion tokens of every request
    new_tokens: int = 0  # tokens a radix-cached server computes (not a prefix seen before)
    split: int = 0  # requests whose new tokens needed several windows
    truncated: int = 0  # requests cut to their last window (split_long=False)
    dropped_tokens: int = 0  # new tokens in no window (truncation, short first windows)
    duplicate_windows: int = 0  # windows identical to one already produced or reserved
    max_request_tokens: int = 0
    request_lengths: list[int] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        lengths = d.pop("request_lengths")
        d["mean_request_tokens"] = (sum(lengths) / len(lengths)) if lengths else 0.0
        d["cached_tokens"] = self.rendered_tokens - self.new_tokens
        return d


@dataclass
class RenderedSessions:
    sequences: list[torch.Tensor]  # int64 [len] each
    stats: TokenStats
    conversation_ids: list[str]  # the conversation each sequence came from


@dataclass(frozen=True)
class ServedRequest:
    """One request of a session as a server sees it: the prompt sent, the completion generated."""

    conversation_id: str
    prompt: list[int]
    completion: list[int]

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.completion


def render_conversation(conv: Conversation, tokenizer: KimiTokenizer, **template_kwargs: Any) -> list[int]:
    """Token ids of one whole session, rendered by the chat template (specials allowed)."""
    return tokenizer.encode_chat(conv.messages, tools=conv.tools, add_generation_prompt=False, **template_kwargs)


def completion_text(message: Message) -> str:
    """An assistant message as the model generated it, up to (not including) its stop token."""
    calls = "".join(f"{CALL_BEGIN}{c.id}{ARGUMENT_BEGIN}{c.function.arguments}{CALL_END}"
                    for c in message.tool_calls or ())
    return (f"{THINK_BEGIN}{message.reasoning_content or ''}{THINK_END}{message.content or ''}"
            + (f"{SECTION_BEGIN}{calls}{SECTION_END}" if calls else ""))


def _without_prompt_owned(prompt: str, completion: str) -> str:
    for prefix in _PROMPT_OWNED_PREFIXES:
        if completion.startswith(prefix) and prompt.endswith(prefix):
            return completion[len(prefix):]
    return completion


def served_requests(conv: Conversation, tokenizer: KimiTokenizer, *, preserve_thinking: bool = False,
                    **template_kwargs: Any) -> list[ServedRequest]:
    """One ServedRequest per assistant message of `conv` (see the module docstring).

    :param preserve_thinking: K2.6's template variable: keep every turn's reasoning in prompts.
    :param template_kwargs: other template variables (e.g. thinking=False for a non-thinking agent).
    """
    out = []
    for i, message in enumerate(conv.messages):
        if message.role is not Role.ASSISTANT:
            continue
        prompt = tokenizer.apply_chat_template(conv.messages[:i], tools=conv.tools, add_generation_prompt=True,
                                               preserve_thinking=preserve_thinking, **template_kwargs)
        completion = _without_prompt_owned(prompt, completion_text(message))
        out.append(ServedRequest(conv.id, tokenizer.encode(prompt, allow_special=True),
                                 tokenizer.encode(completion, allow_special=True)))
    return out


class PrefixTree:
    """Radix tree over token sequences: the longest prefix already inserted (a server's radix cache).

    Edges hold numpy label arrays; a node is a dict from an edge's first token to [label, child].
    """

    def __init__(self) -> None:
        self._root: dict[int, list[Any]] = {}

    @staticmethod
    def _common(label: np.ndarray, seq: np.ndarray, start: int) -> int:
        n = min(len(label), len(seq) - start)
        differ = np.flatnonzero(label[:n] != seq[start:start + n])
        return int(differ[0]) if differ.size else n

    def match(self, seq: np.ndarray) -> int:
        """Length of the longest prefix of `seq` that was inserted."""
        node, i = self._root, 0
        while i < len(seq):
            edge = node.get(int(seq[i]))
            if edge is None:
                return i
            label, child = edge
            n = self._common(label, seq, i)
            i += n
            if n < len(label):
                return i
            node = child
        return i

    def insert(self, seq: np.ndarray) -> None:
        node, i = self._root, 0
        while i < len(seq):
            key = int(seq[i])
            edge = node.get(key)
            if edge is None:
                node[key] = [seq[i:].copy(), {}]  # own copy: the tree holds each distinct token once
                return
            label, child = edge
            n = self._common(label, seq, i)
            if n < len(label):  # split the edge where the sequences part
                child = {int(label[n]): [label[n:], child]}
                edge[0], edge[1] = label[:n], child
            i += n
            node = child


def _window_ends(length: int, new_from: int, seq_len: int) -> Iterator[int]:
    """Ends of the windows covering positions [new_from, length), from the last one backwards."""
    end = length
    while end > new_from:
        yield end
        end -= seq_len


def _digest(window: np.ndarray) -> bytes:
    return hashlib.blake2b(window.tobytes(), digest_size=16).digest()


class _WindowCutter:
    """Cuts the windows of requests in order, against one prefix tree and one set of seen windows."""

    def __init__(self, seq_len: int, split_long: bool):
        self.seq_len = seq_len
        self.split_long = split_long
        self.tree = PrefixTree()
        self.seen: set[bytes] = set()

    def cut(self, request: ServedRequest, stats: TokenStats) -> list[np.ndarray]:
        seq = np.asarray(request.tokens, dtype=np.int64)
        new_from = self.tree.match(seq)
        self.tree.insert(seq)
        stats.requests += 1
        stats.rendered_tokens += len(seq)
        stats.new_tokens += len(seq) - new_from
        stats.request_lengths.append(len(seq))
        stats.max_request_tokens = max(stats.max_request_tokens, len(seq))
        ends = list(_window_ends(len(seq), new_from, self.seq_len))
        if not self.split_long and len(ends) > 1:
            stats.truncated += 1
            stats.dropped_tokens += ends[0] - self.seq_len - new_from
            ends = ends[:1]
        elif len(ends) > 1:
            stats.split += 1
        windows = []
        for k, end in enumerate(ends):
            start = max(0, end - self.seq_len)
            if end - start < MIN_TAIL_WINDOW_TOKENS and len(ends) > 1 and k == len(ends) - 1:
                stats.dropped_tokens += end - max(start, new_from)
                continue
            window = seq[start:end]
            key = _digest(window)
            if key in self.seen:
                stats.duplicate_windows += 1
                continue
            self.seen.add(key)
            windows.append(window)
        return windows[::-1]  # in order of position


class _Group(Protocol):
    id: str
    requests: Sequence[ServedRequest]


def window_groups(groups: Sequence[_Group], seq_len: int, *, split_long: bool = True,
                  exclude: Sequence[_Group] = ()) -> RenderedSessions:
    """The distinct windows of already-tokenized served requests, grouped by conversation (`id`, `requests`):
    what `render_sessions_with_stats` does after rendering, shared with served traffic (data/traffic.py)."""
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    cutter = _WindowCutter(seq_len, split_long)
    reserved = TokenStats()
    for group in exclude:
        for request in group.requests:
            cutter.cut(request, reserved)
    stats = TokenStats()
    sequences: list[torch.Tensor] = []
    ids_of: list[str] = []
    for group in groups:
        stats.conversations += 1
        for request in group.requests:
            for window in cutter.cut(request, stats):
                sequences.append(torch.from_numpy(window.copy()))
                ids_of.append(group.id)
    stats.samples = len(sequences)
    stats.tokens = sum(int(s.numel()) for s in sequences)
    return RenderedSessions(sequences, stats, ids_of)


@dataclass
class SessionRequests:
    """A conversation's served requests, rendered (the group `window_groups` reads)."""

    id: str
    requests: list[ServedRequest]


def render_sessions_with_stats(convs: Sequence[Conversation], tokenizer: KimiTokenizer, seq_len: int, *,
                               split_long: bool = True, preserve_thinking: bool = False,
                               exclude: Sequence[Conversation] = (), **template_kwargs: Any) -> RenderedSessions:
    """The distinct windows (at most `seq_len` tokens) of every session's served requests.

    :param split_long: True: a request's new tokens get as many windows as they need; False: only
        the last window (ending at the completion) of each request.
    :param preserve_thinking: K2.6's template variable, see `served_requests`.
    :param exclude: sessions rendered first whose windows are reserved, never returned (the other
        part of a split): the returned windows are disjoint from theirs.
    """
    def rendered(some: Sequence[Conversation]) -> list[SessionRequests]:
        return [SessionRequests(c.id, served_requests(c, tokenizer, preserve_thinking=preserve_thinking,
                                                      **template_kwargs)) for c in some]

    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    return window_groups(rendered(convs), seq_len, split_long=split_long, exclude=rendered(exclude))


def render_sessions(convs: Sequence[Conversation], tokenizer: KimiTokenizer, seq_len: int, *,
                    split_long: bool = True, preserve_thinking: bool = False,
                    exclude: Sequence[Conversation] = (), **template_kwargs: Any) -> list[torch.Tensor]:
    """Token sequences (int64, each at most `seq_len` long) of the sessions' served requests."""
    return render_sessions_with_stats(convs, tokenizer, seq_len, split_long=split_long,
                                      preserve_thinking=preserve_thinking, exclude=exclude,
                                      **template_kwargs).sequences


# The first 64 bits of sha256(seed:id) as a fraction of 2**64 place a session in [0, 1).
_SPLIT_KEY_HEX_CHARS = 16
_SPLIT_KEY_SCALE = float(1 << 64)


def _split_key(conv_id: str, seed: int) -> float:
    return int(hashlib.sha256(f"{seed}:{conv_id}".encode()).hexdigest()[:_SPLIT_KEY_HEX_CHARS], 16) / _SPLIT_KEY_SCALE


def split_heldout(convs: Sequence[Conversation], heldout_fraction: float = DEFAULT_HELDOUT_FRACTION,
                  seed: int = 0) -> tuple[list[Conversation], list[Conversation]]:
    """(calibration, heldout): a session is held out when sha256(seed:id), read as a fraction of 2**64,
    is below `heldout_fraction`.

    Each session's side depends on its id and the seed alone, not on which other sessions were
    loaded: calibrate and validate may load different numbers of generated sessions (each makes
    enough for its own --samples) and still agree on every session they share. (A split that held
    out the `round(n * fraction)` smallest keys did not: a session could be calibration among 40
    sessions and held out among 160.) Both parts keep the input order; duplicates (same id) land
    on the same side. Only when the threshold leaves a side empty and there are two sessions or
    more, the session nearest the threshold moves over, so each side has one. Sessions can still
    share text (a system prompt, tool declarations): render the held-out part with
    `exclude=calibration` so its windows are disjoint from the calibration windows.
    """
    if not 0.0 <= heldout_fraction <= 1.0:
        raise ValueError(f"heldout_fraction must be in [0, 1], got {heldout_fraction}")
    keys = {c.id: _split_key(c.id, seed) for c in convs}
    heldout_ids = {i for i, k in keys.items() if k < heldout_fraction}
    if len(keys) >= 2 and 0.0 < heldout_fraction < 1.0:
        if not heldout_ids:
            heldout_ids = {min(keys, key=keys.__getitem__)}
        elif heldout_ids == set(keys):
            heldout_ids -= {max(keys, key=keys.__getitem__)}
    calibration = [c for c in convs if c.id not in heldout_ids]
    heldout = [c for c in convs if c.id in heldout_ids]
    return calibration, heldout
