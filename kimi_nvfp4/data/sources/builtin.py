"""`builtin`: agent sessions generated over the Python stdlib's json, email and asyncio packages."""

from __future__ import annotations

from ..agent_sessions import generate_agent_sessions
from ..source_registry import DataSource, LoadContext, LoadResult, Provenance


def _load(ctx: LoadContext) -> LoadResult:
    convs = generate_agent_sessions(None, n=ctx.n_sessions, seed=ctx.seed, max_turns=ctx.max_turns,
                                    progress=ctx.progress)
    return LoadResult(conversations=convs, source=ctx.part)


PLUGIN = DataSource("builtin", "agent sessions generated over stdlib json/email/asyncio (doctests executed)",
                    usage="builtin", provenance=Provenance.GENERATED, takes_body=False, load=_load)
