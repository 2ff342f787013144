"""`sglang-log:DIR`: SGLang JSON request logs at level 3 (data/sglang_records.py), token ids as served.

Only `request.finished` events are read (a `request.received` line repeats the same prompt). A log written at a
level that drops or cuts prompts (<= 2) is refused as a whole, naming the file and line: calibrating on cut
prompts would be silently wrong.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import DataError
from ..loaders import add_request
from ..sglang_records import FINISHED_EVENT, check_untruncated, log_files, log_line_json, request_from_entry
from ..source_registry import DataSource, LoadContext, LoadResult, Provenance, TrafficOptions
from ..chat_formats import timestamp


def _load(ctx: LoadContext) -> LoadResult:
    result = LoadResult(source=ctx.part)
    files = log_files(Path(ctx.body))
    if not files:
        raise DataError("holds no request log ({host}_{rank}.log)", file=ctx.body)
    for path in files:
        result.files += 1
        with path.open(encoding="utf-8", errors="strict") as f:
            for line_no, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                where = f"{path}:{line_no}"
                try:
                    record = log_line_json(line)
                except ValueError as e:
                    result.note_skip(f"{where}: malformed JSON ({type(e).__name__})", "malformed JSON")
                    continue
                if not isinstance(record, dict) or record.get("event") != FINISHED_EVENT:
                    continue  # received events, other log messages: not a finished request
                obj, out = record.get("obj") or {}, record.get("out") or {}
                check_untruncated(path, line_no, obj, out)
                add_request(result, where, lambda w, r: request_from_entry(
                    w, r["obj"], r["out"], timestamp(r.get("timestamp"))), {"obj": obj, "out": out,
                                                                         "timestamp": record.get("timestamp")})
    return result.require_some()


PLUGIN = DataSource("sglang-log", "SGLang --log-requests-level 3 --log-requests-format json logs (token ids as "
                    "served; truncating levels refused)", usage="sglang-log:DIR", provenance=Provenance.AS_SERVED,
                    options_model=TrafficOptions, load=_load)
