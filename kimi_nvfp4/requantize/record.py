"""requantize's record in the manifest (`stages.requantize`): which statistics and method produced which shard.

`outputs` holds a `RequantizeRecord`. It is saved after every rewritten shard (atomically, with the shard's new
`ShardRecord` in `manifest.shards`), so a killed run resumes at the first shard not recorded: a shard is finished
when its entry names the same method and the same statistics files (sha256), and its bytes are still those the
entry records. The shard's `ShardRecord.settings_sha256` becomes `requantized_sha256(...)`, so a later `convert`
resume never mistakes a requantized shard for its own output.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

REQUANTIZE_STAGE = "requantize"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RequantizedShard(_Strict):
    """One rewritten shard: its bytes, and what produced them."""

    sha256: str
    method: str
    statistics: dict[str, str]  # statistics file (relative to the output) -> its sha256, for the layers in it
    experts: int  # expert inputs (gate+up, down) refined in this shard
    sources: dict[str, int] = Field(default_factory=dict)  # experts per statistics source (refine.StatisticsSource)
    matrices_kept_search: int = 0  # matrices where int4-aware's result was kept (refinement not better)
    # the method's whole typed options (`--method-option`); {} in records written before methods had options
    method_options: dict[str, Any] = Field(default_factory=dict)


class RequantizeRecord(_Strict):
    method: str
    statistics_mode: str
    shards: dict[str, RequantizedShard] = Field(default_factory=dict)
    recalibrated: bool = False

    def finished(self, file: str, method: str, statistics: dict[str, str], current_sha256: str | None,
                 method_options: dict[str, Any] | None = None) -> bool:
        entry = self.shards.get(file)
        return (entry is not None and entry.method == method and entry.statistics == statistics
                and entry.sha256 == current_sha256 and entry.method_options == (method_options or {}))

    def counts(self) -> dict[str, int]:
        totals: dict[str, int] = {}
        for entry in self.shards.values():
            for key, n in entry.sources.items():
                totals[key] = totals.get(key, 0) + n
            totals["matrices_kept_search"] = totals.get("matrices_kept_search", 0) + entry.matrices_kept_search
        return dict(sorted(totals.items()))


def requantized_sha256(method: str, statistics: dict[str, str], conversion_digest: str,
                       method_options: dict[str, Any] | None = None) -> str:
    """What decides a requantized shard's bytes besides its own non-expert tensors: the method and its options, the
    statistics files and the conversion (settings and source)."""
    payload = json.dumps({"method": method, "method_options": method_options or {}, "statistics": statistics,
                          "conversion": conversion_digest}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()
