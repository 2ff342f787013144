"""`hf:NAME[:SPLIT]`: a Hugging Face dataset with a `messages` (or ShareGPT `conversations`) column."""

from __future__ import annotations

from ..loaders import load_hf_dataset, parse_hf_spec
from ..source_registry import DataSource, LoadContext, LoadResult, Provenance


def _load(ctx: LoadContext) -> LoadResult:
    name, split = parse_hf_spec(ctx.body)
    return load_hf_dataset(name, split)


PLUGIN = DataSource("hf", "a Hugging Face dataset: hub id, save_to_disk folder or .json/.jsonl file (split: train)",
                    usage="hf:NAME[:SPLIT]", provenance=Provenance.RE_RENDERED, load=_load)
