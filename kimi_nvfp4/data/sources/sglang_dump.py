"""`sglang-dump:DIR`: SGLang request dumps and crash dumps, token ids as served (data/sglang_records.py).

Each pickle is read with the restricted unpickler (data/safe_pickle.py), one file at a time: memory is bounded by
the largest file (SGLang writes one per `dump_requests_threshold` requests), not by the folder.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import DataError
from ..sglang_records import dump_entries, dump_files, request_from_entry
from ..source_registry import DataSource, LoadContext, LoadResult, Provenance, TrafficOptions

ENTRY_FIELDS = 4  # (GenerateReqInput, out_dict, created_time, finished_time)


def _entry(where: str, entry: object):
    if not isinstance(entry, (tuple, list)) or len(entry) != ENTRY_FIELDS:
        raise ValueError("not a (request, output, created, finished) entry")
    obj, out, created, finished = entry
    return request_from_entry(where, obj, out, created, finished)


def iter_dump(folder: str | Path, result: LoadResult):
    """(where, entry) of every request in the folder's dumps, file by file."""
    files = dump_files(Path(folder))
    if not files:
        raise DataError("holds no .pkl dump (expected SGLang's {timestamp}.pkl or {host}/crash_dump_*.pkl)",
                        file=folder)
    for path in files:
        result.files += 1
        for index, entry in dump_entries(path):
            yield f"{path}:{index}", entry


def _load(ctx: LoadContext) -> LoadResult:
    result = LoadResult(source=ctx.part)
    for where, entry in iter_dump(ctx.body, result):
        _add(result, where, entry)
    return result.require_some()


def _add(result: LoadResult, where: str, entry: object) -> None:
    try:
        result.requests.append(_entry(where, entry))
    except (ValueError, TypeError, AttributeError) as e:
        result.note_skip(f"{where}: {e}", "invalid request")


PLUGIN = DataSource("sglang-dump", "SGLang --dump-requests-folder / --crash-dump-folder pickles (token ids as "
                    "served; read without running them)", usage="sglang-dump:DIR", provenance=Provenance.AS_SERVED,
                    options_model=TrafficOptions, load=_load)
