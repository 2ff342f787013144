"""Reading and windowing served traffic (bench.speed.traffic_import): records/s and peak RSS per path."""

from __future__ import annotations

from .common import BlockContext, grouped, num, provenance, renderer, table, thousands

_MODES = (("read_streaming", "read only (requests counted and dropped)"),
          ("read_all", "read, every request held"),
          ("window_streaming", "read + group + window + pick, bounded (data/stream_windows.py)"),
          ("window_in_memory", "read + group + window + pick, in memory (data/windows.py)"))


@renderer("traffic_window_memory")
def traffic_window_memory(ctx: BlockContext) -> str:
    """One row per (result file, path): peak RSS above the imports is the data's own memory."""
    rows = []
    for r in ctx.results:
        r.require("settings", "folder", "read_streaming")
        d = r.data
        for key, what in _MODES:
            mode = d.get(key)
            if not isinstance(mode, dict):
                continue
            rows.append([grouped(d["settings"]["requests"]), num(d["folder"]["mib"], 1), what,
                         thousands(mode.get("requests_per_s")), num(mode.get("peak_rss_over_imports_mib"), 1),
                         num(mode.get("peak_rss_mib"), 1)])
    headers = ["requests", "folder MiB", "path", "requests/s", "peak RSS over imports MiB", "peak RSS MiB"]
    return "\n\n".join([provenance(ctx), table(headers, rows)])
