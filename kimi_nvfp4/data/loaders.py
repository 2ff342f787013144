"""Where sessions come from: JSONL files, Hugging Face datasets, generated agent sessions.

`resolve_data_spec` turns the CLI's `--data` strings into conversations:

    jsonl:PATH | PATH.jsonl     OpenAI-format sessions, one JSON object per line
    hf:NAME[:SPLIT]             a Hugging Face dataset (hub name, `save_to_disk` folder or .json/.jsonl file)
    tree:PATH                   agent sessions generated over a local source tree
    builtin                     agent sessions generated over Python stdlib packages
    sample                      the shipped example file (sample_sessions.jsonl)

Several specs may be joined with commas; duplicates (same conversation id) are kept once.
Unusable records are skipped and counted, never silently dropped; if nothing usable remains the
loader raises `DataError`.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Iterable, Mapping

from pydantic import ValidationError

from .agent_sessions import DEFAULT_MAX_TURNS, DEFAULT_SESSIONS, generate_agent_sessions
from .conversations import Conversation
from .errors import DataError

log = logging.getLogger(__name__)

SAMPLE_SESSIONS_FILE = "sample_sessions.jsonl"
DEFAULT_HF_SPLIT = "train"
# How many skip reasons a LoadResult keeps verbatim (the count is always exact).
MAX_RECORDED_ERRORS = 100
# Fields that name the message list / tool list in common chat datasets.
MESSAGE_FIELDS = ("messages", "conversation", "conversations")
TOOLS_FIELD = "tools"
# ShareGPT-style role names -> OpenAI roles.
_SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "system": "system", "observation": "tool"}


@dataclass
class LoadResult:
    """Conversations read from one source, and what was skipped (with reasons)."""

    conversations: list[Conversation]
    skipped: int = 0
    errors: list[str] = field(default_factory=list)
    source: str = ""

    def note_skip(self, reason: str) -> None:
        self.skipped += 1
        if len(self.errors) < MAX_RECORDED_ERRORS:
            self.errors.append(reason)

    def summary(self) -> str:
        return f"{self.source}: {len(self.conversations)} conversations, {self.skipped} skipped"


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
        result.note_skip(f"{where}: {_short_validation_error(e)}")
    except (ValueError, TypeError) as e:
        result.note_skip(f"{where}: {e}")


def _collect(records: Iterable[tuple[str, Any]], source: str) -> LoadResult:
    result = LoadResult(conversations=[], source=source)
    for where, record in records:
        _add_record(result, where, record)
    return result


def _require_some(result: LoadResult) -> LoadResult:
    if not result.conversations:
        detail = f"; first problem: {result.errors[0]}" if result.errors else ""
        raise DataError(f"{result.source}: no usable conversations ({result.skipped} records skipped{detail})")
    if result.skipped:
        log.warning("%s (first: %s)", result.summary(), result.errors[0])
    return result


def load_jsonl(path: str | Path) -> LoadResult:
    """Read OpenAI-format sessions (`{"messages": [...], "tools": [...]}` per line).

    Empty lines, malformed JSON and invalid conversations (unknown roles, tool results without a
    call, ...) are skipped and counted with their line numbers.
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(f"file {path}: not found (expected a JSONL file of conversations)")
    result = LoadResult(conversations=[], source=str(path))
    try:
        with path.open(encoding="utf-8") as f:
            for line_no, line in enumerate(f, start=1):
                where = f"{path}:{line_no}"
                if not line.strip():
                    result.note_skip(f"{where}: empty line")
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    result.note_skip(f"{where}: malformed JSON ({e.msg} at column {e.colno})")
                    continue
                _add_record(result, where, record)
    except UnicodeDecodeError as e:
        raise DataError(f"file {path}: not UTF-8 text ({e})") from e
    return _require_some(result)


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
    return _require_some(_collect(rows, f"hf:{name}:{split}"))


def sample_sessions_path() -> Path:
    """The shipped example sessions (generated over the stdlib `json` package)."""
    return Path(str(resources.files(__package__).joinpath(SAMPLE_SESSIONS_FILE)))


def _parse_hf_spec(body: str) -> tuple[str, str]:
    # NAME may itself contain ':' only as a Windows drive; split on the last ':' when it names a split.
    name, sep, split = body.rpartition(":")
    if sep and name and "/" not in split and not Path(body).exists():
        return name, split
    return body, DEFAULT_HF_SPLIT


def load_data_spec(spec: str, *, n_sessions: int = DEFAULT_SESSIONS, seed: int = 0,
                   max_turns: int = DEFAULT_MAX_TURNS, progress: bool = False) -> list[LoadResult]:
    """Like `resolve_data_spec` but one LoadResult per comma-separated part (for reports)."""
    parts = [p.strip() for p in spec.split(",") if p.strip()]
    if not parts:
        raise DataError("empty --data spec (expected jsonl:PATH, hf:NAME[:SPLIT], tree:PATH, builtin or sample)")
    results = []
    for part in parts:
        kind, _, body = part.partition(":")
        if kind == "jsonl" and body:
            results.append(load_jsonl(body))
        elif part.endswith(".jsonl") and ":" not in part:
            results.append(load_jsonl(part))
        elif kind == "hf" and body:
            name, split = _parse_hf_spec(body)
            results.append(load_hf_dataset(name, split))
        elif kind == "tree" and body:
            convs = generate_agent_sessions(body, n=n_sessions, seed=seed, max_turns=max_turns, progress=progress)
            results.append(LoadResult(conversations=convs, source=part))
        elif part == "builtin":
            convs = generate_agent_sessions(None, n=n_sessions, seed=seed, max_turns=max_turns, progress=progress)
            results.append(LoadResult(conversations=convs, source=part))
        elif part == "sample":
            results.append(load_jsonl(sample_sessions_path()))
        else:
            raise DataError(f"--data {part!r}: expected jsonl:PATH, PATH.jsonl, hf:NAME[:SPLIT], tree:PATH, "
                            "builtin or sample")
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
