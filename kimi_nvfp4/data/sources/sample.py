"""`sample`: the shipped example sessions (kimi_nvfp4/data/sample_sessions.jsonl)."""

from __future__ import annotations

from ..loaders import load_jsonl, sample_sessions_path
from ..source_registry import DataSource, LoadContext, LoadResult, Provenance


def _load(ctx: LoadContext) -> LoadResult:
    return load_jsonl(sample_sessions_path())


PLUGIN = DataSource("sample", "the 6 shipped example sessions (sample_sessions.jsonl)", usage="sample",
                    provenance=Provenance.GENERATED, takes_body=False, load=_load)
