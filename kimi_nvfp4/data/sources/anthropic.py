"""`anthropic:FILE`: Anthropic Messages request bodies, one per line (or `{"request", "response"}`), mapped to
Kimi's messages and re-rendered with the checkpoint's chat template (data/chat_formats.py)."""

from __future__ import annotations

from ..chat_formats import anthropic_request
from ..loaders import add_request, iter_json_lines
from ..source_registry import DataSource, LoadContext, LoadResult, Provenance, TrafficOptions


def _load(ctx: LoadContext) -> LoadResult:
    result = LoadResult(source=ctx.part)
    for where, record in iter_json_lines(ctx.body, result):
        add_request(result, where, anthropic_request, record)
    return result.require_some()


PLUGIN = DataSource("anthropic", "Anthropic Messages request logs, JSON lines (mapped to Kimi messages, "
                    "re-rendered)", usage="anthropic:FILE", provenance=Provenance.RE_RENDERED,
                    options_model=TrafficOptions, load=_load)
