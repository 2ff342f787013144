"""`tree:PATH`: agent sessions generated over a local source tree (compile-only checks)."""

from __future__ import annotations

from ..agent_sessions import generate_agent_sessions
from ..source_registry import DataSource, LoadContext, LoadResult, Provenance


def _load(ctx: LoadContext) -> LoadResult:
    convs = generate_agent_sessions(ctx.body, n=ctx.n_sessions, seed=ctx.seed, max_turns=ctx.max_turns,
                                    progress=ctx.progress)
    return LoadResult(conversations=convs, source=ctx.part)


PLUGIN = DataSource("tree", "agent sessions generated over a local source tree (its code is compiled, not run)",
                    usage="tree:PATH", provenance=Provenance.GENERATED, load=_load)
