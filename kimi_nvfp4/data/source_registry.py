"""The `--data` vocabulary: data sources as registered plugins (kimi_nvfp4/plugins.py), one module each in
`kimi_nvfp4/data/sources/`.

A spec part is `KIND:BODY` (`sglang-dump:/var/dumps`), a bare kind (`builtin`, `sample`), or a bare
`PATH.jsonl`; options follow a `?` as `key=value` pairs joined by `&` (`openai:log.jsonl?preserve_thinking=true`)
and are checked by the source's own pydantic options model. Parts are joined with commas. Every help text and
error that lists the kinds is generated from `DATA_SOURCES` (`spec_help`), never written out by hand.

Adding a source is adding one module to the catalog that defines `PLUGIN = DataSource(...)`, plus its tests.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

from pydantic import BaseModel, ConfigDict, Field

from ..plugins import Plugin, PluginError, Registry, parse_option_pairs
from .conversations import Conversation
from .errors import DataError
from .traffic import TrafficRequest

log = logging.getLogger(__name__)

# How many skip reasons a LoadResult keeps verbatim (the count is always exact).
MAX_RECORDED_ERRORS = 100
# More bad records than this fraction of a source fails the run before any layer (issue #27 "Bad input").
DEFAULT_MAX_BAD_FRACTION = 0.01


class Provenance:
    """How a source's tokens relate to what the server computed (docs/data.md)."""

    AS_SERVED = "as served"  # the token ids the server saw (or its rendered text, tokenized)
    RE_RENDERED = "re-rendered"  # messages rendered with the checkpoint's chat template
    GENERATED = "generated"  # sessions made here, rendered with the checkpoint's chat template


@dataclass
class LoadResult:
    """What one source gave: conversations (whole sessions) and/or recorded requests, and what was skipped.

    Skipped records are counted per reason (`skip_counts`, e.g. "malformed JSON": 3) and the first
    `MAX_RECORDED_ERRORS` are kept with their file and record (`errors`), never with their content.
    """

    conversations: list[Conversation] = field(default_factory=list)
    requests: list[TrafficRequest] = field(default_factory=list)
    skipped: int = 0
    errors: list[str] = field(default_factory=list)
    source: str = ""
    skip_counts: Counter = field(default_factory=Counter)
    files: int = 0
    provenance: str = ""  # the source's Provenance, set by load_data_spec

    def note_skip(self, reason: str, category: str = "invalid record") -> None:
        self.skipped += 1
        self.skip_counts[category] += 1
        if len(self.errors) < MAX_RECORDED_ERRORS:
            self.errors.append(reason)

    @property
    def read(self) -> int:
        return len(self.conversations) + len(self.requests) + self.skipped

    def summary(self) -> str:
        return (f"{self.source}: {len(self.conversations)} conversations, {len(self.requests)} requests, "
                f"{self.skipped} skipped")

    def require_some(self) -> LoadResult:
        """Raise DataError when nothing usable was read; warn with the first reason when some was skipped."""
        if not self.conversations and not self.requests:
            detail = f"; first problem: {self.errors[0]}" if self.errors else ""
            raise DataError(f"{self.source}: no usable conversations ({self.skipped} records skipped{detail})")
        if self.skipped:
            log.warning("%s (first: %s)", self.summary(), self.errors[0])
        return self


def check_bad_fraction(results: list[LoadResult], max_fraction: float = DEFAULT_MAX_BAD_FRACTION) -> None:
    """Refuse a source whose skipped records exceed `max_fraction` of what it read (named, with the first)."""
    for r in results:
        if r.read and r.skipped / r.read > max_fraction:
            reasons = ", ".join(f"{n} {k}" for k, n in r.skip_counts.most_common())
            first = f"; first: {r.errors[0]}" if r.errors else ""
            raise DataError(
                f"{r.source}: {r.skipped} of {r.read} records are unreadable ({r.skipped / r.read:.1%}, more than "
                f"the {max_fraction:.0%} allowed: {reasons}){first}; fix or remove them")


class TrafficOptions(BaseModel):
    """Options of the served-traffic sources (`KIND:PATH?outputs=false`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    outputs: bool = Field(True, description="append each finished request's completion to its prompt")


@dataclass(frozen=True)
class LoadContext:
    """What a source's loader gets: the spec part's body and options, and the generators' settings."""

    part: str
    body: str
    options: BaseModel
    n_sessions: int
    seed: int
    max_turns: int
    progress: bool = False


@dataclass(frozen=True)
class DataSource(Plugin):
    """A `--data` kind: how it is written (`usage`), whether its tokens are as served, and its loader."""

    usage: str = field(default="", kw_only=True)  # e.g. "sglang-dump:DIR"
    provenance: str = field(default=Provenance.RE_RENDERED, kw_only=True)
    takes_body: bool = field(default=True, kw_only=True)
    load: Callable[[LoadContext], LoadResult] = field(default=None, kw_only=True)  # type: ignore[assignment]


DATA_SOURCES: Registry[DataSource] = Registry("data source", DataSource, catalog="kimi_nvfp4.data.sources")


def spec_help() -> str:
    """One line listing every kind as users write it (for --help texts and errors)."""
    return " | ".join(s.usage for s in DATA_SOURCES.entries()) + " (comma-separated to mix)"


def parse_part(part: str) -> tuple[DataSource, str, BaseModel]:
    """(source, body, options) of one spec part; DataError naming the kinds when it matches none."""
    head, _, query = part.partition("?")
    kind, sep, body = head.partition(":")
    if head.endswith(".jsonl") and (not sep or kind not in DATA_SOURCES):
        kind, body = "jsonl", head  # a bare PATH.jsonl (a Windows drive letter is not a kind)
    if kind not in DATA_SOURCES:
        raise DataError(f"--data {part!r}: unknown kind {kind!r}; expected {spec_help()}")
    source = DATA_SOURCES.get(kind)
    if source.takes_body != bool(body):
        raise DataError(f"--data {part!r}: expected {source.usage}")
    try:
        options = source.parse_options(parse_option_pairs(query.split("&")) if query else None)
    except PluginError as e:
        raise DataError(f"--data {part!r}: {e}") from None
    return source, body, options
