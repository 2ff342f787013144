"""`openai:FILE`: OpenAI chat-completions request bodies as proxies log them, one JSON object per line
(`messages`, `tools`, `chat_template_kwargs`, optionally the `response`), re-rendered with the checkpoint's
chat template (data/chat_formats.py)."""

from __future__ import annotations

from ..chat_formats import openai_request
from ..loaders import add_request, iter_json_lines
from ..source_registry import DataSource, LoadContext, LoadResult, Provenance, TrafficOptions


def _load(ctx: LoadContext) -> LoadResult:
    result = LoadResult(source=ctx.part)
    for where, record in iter_json_lines(ctx.body, result):
        add_request(result, where, openai_request, record)
    return result.require_some()


PLUGIN = DataSource("openai", "OpenAI chat-completions request logs, JSON lines (re-rendered with the template)",
                    usage="openai:FILE", provenance=Provenance.RE_RENDERED, options_model=TrafficOptions,
                    load=_load)
