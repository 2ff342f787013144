"""SGLang's own records of served requests: request dumps, crash dumps and JSON request logs.

Field names are SGLang's (sglang/srt/managers/tokenizer_manager.py `dump_requests`, `dump_requests_before_crash`;
io_struct.py `GenerateReqInput`; utils/request_logger.py, utils/log_utils.py `log_json`):

- dump folder (`--dump-requests-folder DIR`, `POST /configure_logging`): `{timestamp}.pkl` per
  `dump_requests_threshold` finished requests, holding `{"server_args", "config_updates", "resolved_config",
  "requests": [(GenerateReqInput, out_dict, created_time, finished_time), ...]}`; older versions pickled the bare
  list of tuples. Crash dumps (`--crash-dump-folder`) are `{host}/crash_dump_*.pkl` of the same shape (plus
  `launch_command`) and include unfinished requests, whose output is not appended.
- request log (`--log-requests --log-requests-format json --log-requests-target DIR`): `{host}_{rank}.log` (and
  its hourly rotations), lines `[YYYY-mm-dd HH:MM:SS] {"timestamp", "event", "rid", "obj", "out"}`; the
  `request.finished` events carry the request (`obj`) and its output (`out`).

`out_dict` is `{"text", "output_ids", "meta_info": {"id", "finish_reason": {"type": "stop"|"length"|"abort",...},
"prompt_tokens", "completion_tokens", ...}}`. The prompt is `input_ids` when the request carried ids, else the
rendered `text` (multimodal architectures such as K2.5/K2.6 receive text).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator, Mapping

from .errors import DataError, TruncatedLogError
from .safe_pickle import PlainRecord, load_dump
from .traffic import TrafficRequest

COMPLETE_FINISH_TYPES = frozenset({"stop", "length"})
FINISHED_EVENT = "request.finished"
# level 2 cuts strings and lists longer than this to half + "..." + half (request_logger._transform_data_for_logging)
LEVEL2_MAX_LENGTH = 2048
TRUNCATION_MARK = "..."


def _fields(obj: Any) -> Mapping[str, Any]:
    if isinstance(obj, PlainRecord):
        return obj.fields
    if isinstance(obj, Mapping):
        return obj
    raise ValueError(f"expected a GenerateReqInput, got {type(obj).__name__}")


def _ids(value: Any, what: str) -> tuple[int, ...] | None:
    if value is None:
        return None
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{what} is a {type(value).__name__}, not a list of ids")
    if value and isinstance(value[0], (list, tuple)):
        raise ValueError(f"{what} is a batch; SGLang dumps one request per entry")
    if not all(type(i) is int for i in value):
        raise ValueError(f"{what} holds a non-integer")
    return tuple(value)


def request_from_entry(where: str, obj: Any, out: Any, created: Any, finished: Any = None) -> TrafficRequest:
    """One `(GenerateReqInput, out_dict, created, finished)` entry (or a log line's `obj`/`out`)."""
    req = _fields(obj)
    out = out if isinstance(out, Mapping) else {}
    meta = out.get("meta_info") if isinstance(out.get("meta_info"), Mapping) else {}
    finish = meta.get("finish_reason")
    finish_type = finish.get("type") if isinstance(finish, Mapping) else (finish if isinstance(finish, str) else None)
    complete = finish_type in COMPLETE_FINISH_TYPES
    ids = _ids(req.get("input_ids"), "input_ids")
    text = req.get("text")
    if ids is None and not isinstance(text, str):
        if req.get("input_embeds") is not None:
            raise ValueError("the prompt is input_embeds (no token ids or text to calibrate on)")
        raise ValueError("neither input_ids nor text")
    output_ids = _ids(out.get("output_ids"), "output_ids")
    output_text = out.get("text") if isinstance(out.get("text"), str) else None
    sampling = req.get("sampling_params") if isinstance(req.get("sampling_params"), Mapping) else {}
    return TrafficRequest(where, prompt_ids=ids, prompt_text=None if ids is not None else text,
                          output_ids=output_ids, output_text=None if output_ids is not None else output_text,
                          complete=complete, arrival=_seconds(created),
                          session=req.get("session_id") if isinstance(req.get("session_id"), str) else None,
                          finished=_seconds(finished), max_new_tokens=_count(sampling.get("max_new_tokens")),
                          output_tokens=len(output_ids) if output_ids is not None else _count(
                              meta.get("completion_tokens")))


def _seconds(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _count(value: Any) -> int | None:
    return value if type(value) is int and value >= 0 else None


def dump_files(folder: Path) -> list[Path]:
    """The pickles of a dump folder (request dumps at the top, crash dumps under `{host}/`), in name order."""
    if not folder.is_dir():
        raise DataError("not a folder (expected an SGLang --dump-requests-folder or --crash-dump-folder)",
                        file=folder)
    return sorted(p for p in folder.rglob("*.pkl") if p.is_file())


def dump_entries(path: Path) -> Iterator[tuple[int, Any]]:
    """(index, entry) of the requests in one dump file, read with the restricted unpickler (safe_pickle.py)."""
    data = load_dump(path)
    if isinstance(data, Mapping):
        entries = data.get("requests")
    else:
        entries = data  # older SGLang pickled the bare list of tuples
    if not isinstance(entries, (list, tuple)):
        raise DataError("holds no list of requests (not an SGLang request dump)", file=path)
    yield from enumerate(entries)


def log_files(folder: Path) -> list[Path]:
    """Request-log files of a `--log-requests-target` folder (`{host}_{rank}.log` and rotations), or one file."""
    if folder.is_file():
        return [folder]
    if not folder.is_dir():
        raise DataError("not found (expected an SGLang --log-requests-target folder)", file=folder)
    return sorted(p for p in folder.iterdir() if p.is_file() and ".log" in p.name)


def log_line_json(line: str) -> Any:
    """The JSON object of one log line, after the `[date time] ` prefix the file handler adds."""
    start = line.find("{")
    if start < 0:
        raise ValueError("no JSON object on the line")
    return json.loads(line[start:])


def check_untruncated(path: Path, line_no: int, obj: Mapping[str, Any], out: Mapping[str, Any]) -> None:
    """Refuse lines logged at a level that drops or cuts the prompt (levels 0-1 drop it, level 2 cuts text and
    id lists longer than 2048 to half + "..." + half)."""
    if "text" not in obj and "input_ids" not in obj:
        raise TruncatedLogError(
            "the request log has no prompt (written with --log-requests-level 0 or 1); restart the server with "
            "--log-requests-level 3 --log-requests-format json", file=path, record=f"line {line_no}")
    for name, value in (("input_ids", obj.get("input_ids")), ("output_ids", out.get("output_ids"))):
        if isinstance(value, list) and TRUNCATION_MARK in value:
            raise TruncatedLogError(
                f"{name} was cut with '...' (--log-requests-level 2 truncates); use --log-requests-level 3",
                file=path, record=f"line {line_no}")
    half = LEVEL2_MAX_LENGTH // 2
    for name, value in (("text", obj.get("text")), ("out.text", out.get("text"))):
        if (isinstance(value, str) and len(value) == LEVEL2_MAX_LENGTH + len(TRUNCATION_MARK)
                and value[half:half + len(TRUNCATION_MARK)] == TRUNCATION_MARK):
            raise TruncatedLogError(
                f"{name} was cut to {LEVEL2_MAX_LENGTH} characters (--log-requests-level 2 truncates); use "
                "--log-requests-level 3", file=path, record=f"line {line_no}")
