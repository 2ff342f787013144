"""`jsonl:PATH` (or a bare `PATH.jsonl`): OpenAI-format sessions, one JSON object per line."""

from __future__ import annotations

from ..loaders import load_jsonl
from ..source_registry import DataSource, LoadContext, LoadResult, Provenance


def _load(ctx: LoadContext) -> LoadResult:
    return load_jsonl(ctx.body)


PLUGIN = DataSource("jsonl", "OpenAI-format sessions, one JSON object per line (also a bare PATH.jsonl)",
                    usage="jsonl:PATH", provenance=Provenance.RE_RENDERED, load=_load)
