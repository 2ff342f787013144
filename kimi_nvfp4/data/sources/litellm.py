"""`litellm:FILE`: LiteLLM spend logs exported as JSON lines (`messages`, `response`, `proxy_server_request`,
`session_id`), re-rendered with the checkpoint's chat template (data/chat_formats.py)."""

from __future__ import annotations

from ..chat_formats import litellm_row
from ..loaders import add_request, iter_json_lines
from ..source_registry import DataSource, LoadContext, LoadResult, Provenance, TrafficOptions


def _load(ctx: LoadContext) -> LoadResult:
    result = LoadResult(source=ctx.part)
    for where, record in iter_json_lines(ctx.body, result):
        add_request(result, where, litellm_row, record)
    return result.require_some()


PLUGIN = DataSource("litellm", "LiteLLM spend logs as JSON lines (re-rendered with the template)",
                    usage="litellm:FILE", provenance=Provenance.RE_RENDERED, options_model=TrafficOptions,
                    load=_load)
