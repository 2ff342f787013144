"""Where sessions and requests come from: the loaders behind the registered `--data` sources.

The vocabulary itself (`jsonl:PATH`, `sglang-dump:DIR`, ...) is the registry's (data/source_registry.py,
one module per kind in data/sources/); this module holds the readers several sources share (JSON lines with
skip counting, OpenAI-format records, Hugging Face datasets) and `load_data_spec` / `resolve_data_spec`, which
turn a comma-separated `--data` string into one LoadResult per part.

Unusable records are skipped and counted with their file and line, never silently dropped; if nothing usable
remains the loader raises `DataError`.
"""

from __future__ import annotations

import json
from dataclasses import replace
import logging
import os
from importlib import resources
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping

from pydantic import ValidationError

from .agent_sessions import DEFAULT_MAX_TURNS, DEFAULT_SESSIONS
from .conversations import Conversation
from .errors import DataError
from .traffic import TrafficRequest
from .source_registry import LoadContext, LoadResult, parse_part, spec_help

log = logging.getLogger(__name__)

SAMPLE_SESSIONS_FILE = "sample_sessions.jsonl"
DEFAULT_HF_SPLIT = "train"
# Fields that name the message list / tool list in common chat datasets.
MESSAGE_FIELDS = ("messages", "conversation", "conversations")
TOOLS_FIELD = "tools"
# ShareGPT-style role names -> OpenAI roles.
_SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "system": "system", "observation": "tool"}


def _short_validation_error(e: ValidationError) -> str:
    first = e.errors()[0]
    where = ".".join(str(p) for p in first.get("loc", ()))
    return f"{where}: {first.get('msg')}" if where else str(first.get("msg"))


def _sharegpt_to_openai(messages: list[Any]) -> list[Any]:
    if not messages or not isinstance(messages[0], dict) or "from" not in messages[0]:
        return messages
    out = []
    for m in messages:
        role = _SHAREGPT_ROLES.get(m.get("from"), m.get("from"))
        out.append({"role": role, "content": m.get("value")})
    return out


def conversation_from_record(record: Mapping[str, Any]) -> Conversation:
    """One dataset row / JSONL object -> Conversation (raises ValueError/ValidationError when unusable)."""
    if not isinstance(record, Mapping):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    messages = next((record[k] for k in MESSAGE_FIELDS if record.get(k) is not None), None)
    if isinstance(messages, str):  # some datasets store the message list as JSON text
        messages = json.loads(messages)
    if not isinstance(messages, list):
        raise ValueError(f"expected a list under one of {list(MESSAGE_FIELDS)}")
    fields: dict[str, Any] = {"messages": _sharegpt_to_openai(messages), "tools": record.get(TOOLS_FIELD)}
    if isinstance(record.get("id"), str) and record["id"]:
        fields["id"] = record["id"]
    return Conversation.model_validate(fields)


def _add_record(result: LoadResult, where: str, record: Any) -> None:
    try:
        result.conversations.append(conversation_from_record(record))
    except ValidationError as e:
        result.note_skip(f"{where}: {_short_validation_error(e)}", "invalid conversation")
    except (ValueError, TypeError) as e:
        result.note_skip(f"{where}: {e}", "invalid conversation")


def add_request(result: LoadResult, where: str, make: Callable[[str, Any], TrafficRequest], record: Any) -> None:
    """Append `make(where, record)` to `result.requests`, or note why the record is unusable. Reasons name the
    field, never its content (a validation error's input is left out)."""
    try:
        if not isinstance(record, Mapping):
            raise ValueError(f"expected a JSON object, got {type(record).__name__}")
        result.requests.append(make(where, record))
    except ValidationError as e:
        result.note_skip(f"{where}: {_short_validation_error(e)}", "invalid request")
    except KeyError as e:
        result.note_skip(f"{where}: missing field {e}", "invalid request")
    except (ValueError, TypeError, AttributeError) as e:
        result.note_skip(f"{where}: {type(e).__name__}: {str(e)[:200]}", "invalid request")


def _collect(records: Iterable[tuple[str, Any]], source: str) -> LoadResult:
    result = LoadResult(source=source)
    for where, record in records:
        _add_record(result, where, record)
    return result


def iter_json_lines(path: str | Path, result: LoadResult) -> Iterator[tuple[str, Any]]:
    """(`FILE:LINE`, parsed object) per line of a JSON-lines file, streamed; empty and malformed lines are noted
    as skips on `result`. A missing file or one that is not UTF-8 is a DataError naming it."""
    path = Path(path)
    if not path.is_file():
        raise DataError("not found (expected a JSON-lines file)", file=path)
    result.files += 1
    try:
        with path.open(encoding="utf-8") as f:
            for line_no, line in enumerate(f, start=1):
                where = f"{path}:{line_no}"
                if not line.strip():
                    result.note_skip(f"{where}: empty line", "empty line")
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    result.note_skip(f"{where}: malformed JSON ({e.msg} at column {e.colno})", "malformed JSON")
                    continue
                yield where, record
    except UnicodeDecodeError as e:
        raise DataError(f"not UTF-8 text ({e})", file=path) from e


def load_jsonl(path: str | Path) -> LoadResult:
    """Read OpenAI-format sessions (`{"messages": [...], "tools": [...]}` per line).

    Empty lines, malformed JSON and invalid conversations (unknown roles, tool results without a
    call, ...) are skipped and counted with their line numbers.
    """
    result = LoadResult(source=str(path))
    for where, record in iter_json_lines(path, result):
        _add_record(result, where, record)
    return result.require_some()


def save_jsonl(conversations: Iterable[Conversation], path: str | Path) -> Path:
    """Write conversations as JSONL under a temporary name, then rename (atomic)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial")
    with partial.open("w", encoding="utf-8") as f:
        for conv in conversations:
            f.write(conv.to_json_line() + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, path)
    return path


def load_hf_dataset(name: str, split: str = DEFAULT_HF_SPLIT, *, limit: int | None = None,
                    revision: str | None = None) -> LoadResult:
    """Conversations from a Hugging Face dataset with a `messages` (or ShareGPT `conversations`) column.

    `name` may be a hub dataset id, a folder written by `Dataset.save_to_disk`, or a local
    .json/.jsonl file (loaded through `datasets.load_dataset("json", data_files=...)`).
    """
    import datasets

    local = Path(name)
    try:
        if local.is_dir() and any((local / f).is_file() for f in ("dataset_info.json", "dataset_dict.json")):
            loaded = datasets.load_from_disk(str(local))
            dataset = loaded[split] if isinstance(loaded, datasets.DatasetDict) else loaded
        elif local.is_file() and local.suffix in (".json", ".jsonl"):
            dataset = datasets.load_dataset("json", data_files=str(local), split=split)
        else:
            dataset = datasets.load_dataset(name, split=split, revision=revision)
    except KeyError as e:
        raise DataError(f"dataset {name}: no split {split!r}") from e
    except (FileNotFoundError, ValueError, datasets.exceptions.DatasetNotFoundError) as e:
        raise DataError(f"dataset {name} (split {split}): {e}") from e
    if limit is not None:
        dataset = dataset.select(range(min(limit, len(dataset))))
    rows = ((f"{name}[{split}][{i}]", row) for i, row in enumerate(dataset))
    return _collect(rows, f"hf:{name}:{split}").require_some()


def sample_sessions_path() -> Path:
    """The shipped example sessions (generated over the stdlib `json` package)."""
    return Path(str(resources.files(__package__).joinpath(SAMPLE_SESSIONS_FILE)))


def parse_hf_spec(body: str) -> tuple[str, str]:
    """`NAME[:SPLIT]` -> (name, split). NAME may contain ':' only as a Windows drive; split on the last ':'
    when it names a split."""
    name, sep, split = body.rpartition(":")
    if sep and name and "/" not in split and not Path(body).exists():
        return name, split
    return body, DEFAULT_HF_SPLIT


def load_data_spec(spec: str, *, n_sessions: int = DEFAULT_SESSIONS, seed: int = 0,
                   max_turns: int = DEFAULT_MAX_TURNS, progress: bool = False) -> list[LoadResult]:
    """Like `resolve_data_spec` but one LoadResult per comma-separated part (for reports)."""
    parts = [p.strip() for p in spec.split(",") if p.strip()]
    if not parts:
        raise DataError(f"empty --data spec (expected {spec_help()})")
    results = []
    for part in parts:
        source, body, options = parse_part(part)
        context = LoadContext(part=part, body=body, options=options, n_sessions=n_sessions, seed=seed,
                              max_turns=max_turns, progress=progress)
        result = source.load(context)
        result.source = result.source or part
        result.provenance = source.provenance
        if not getattr(options, "outputs", True):  # TrafficOptions: prompts only
            result.requests = [replace(r, complete=False) for r in result.requests]
        results.append(result)
    return results


def resolve_data_spec(spec: str, *, n_sessions: int = DEFAULT_SESSIONS, seed: int = 0,
                      max_turns: int = DEFAULT_MAX_TURNS, progress: bool = False) -> list[Conversation]:
    """All conversations named by a `--data` string, in order, each conversation id once."""
    seen: set[str] = set()
    conversations: list[Conversation] = []
    for result in load_data_spec(spec, n_sessions=n_sessions, seed=seed, max_turns=max_turns, progress=progress):
        for conv in result.conversations:
            if conv.id not in seen:
                seen.add(conv.id)
                conversations.append(conv)
    return conversations
