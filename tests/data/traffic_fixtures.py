"""Recorded-traffic fixtures with upstream field names, built here (no server, no network).

SGLang: `GenerateReqInput` / `ServerArgs` stand-ins are dataclasses registered under SGLang's own module names
while pickling (sglang/srt/managers/io_struct.py, server_args.py), so the pickles name exactly the globals a real
dump names; dumps follow tokenizer_manager.py `_dump_data_to_file` / `dump_requests_before_crash`, logs
request_logger.py + log_utils.py `log_json` behind the file handler's `[date time] ` prefix.
"""

from __future__ import annotations

import dataclasses
import json
import pickle
import sys
import types
from contextlib import contextmanager
from pathlib import Path
from typing import Any

IO_STRUCT = "sglang.srt.managers.io_struct"
SERVER_ARGS = "sglang.srt.server_args"
T0 = 1_760_000_000.0


@dataclasses.dataclass
class GenerateReqInput:
    text: Any = None
    input_ids: Any = None
    input_embeds: Any = None
    image_data: Any = None
    sampling_params: Any = None
    rid: Any = None
    session_id: Any = None
    return_logprob: Any = None
    stream: bool = False
    log_metrics: bool = True


@dataclasses.dataclass
class ServerArgs:
    model_path: str = "/models/Kimi-K2.6"
    trust_remote_code: bool = True
    tp_size: int = 8


@contextmanager
def sglang_names():
    """Register the stand-ins under SGLang's module names for pickle.dumps (restored afterwards)."""
    saved = {name: sys.modules.get(name) for name in (IO_STRUCT, SERVER_ARGS)}
    for name, cls in ((IO_STRUCT, GenerateReqInput), (SERVER_ARGS, ServerArgs)):
        module = types.ModuleType(name)
        setattr(module, cls.__name__, cls)
        cls.__module__ = name
        sys.modules[name] = module
    try:
        yield
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


def out_dict(output_ids: list[int] | None, finish: str = "stop") -> dict:
    return {"text": "decoded", "output_ids": output_ids,
            "meta_info": {"id": "r", "finish_reason": {"type": finish}, "prompt_tokens": 0,
                          "completion_tokens": len(output_ids or ()), "cached_tokens": 0, "e2e_latency": 0.1}}


def entry(input_ids=None, output_ids=None, *, text=None, finish="stop", t=0.0, session=None):
    req = GenerateReqInput(text=text, input_ids=input_ids, sampling_params={"max_new_tokens": 8}, rid=f"r{t}",
                           session_id=session)
    return (req, out_dict(output_ids, finish), T0 + t, T0 + t + 1.0)


def write_dump(path: Path, entries: list, *, bare: bool = False, crash: bool = False) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with sglang_names():
        data = entries if bare else {"server_args": ServerArgs(), "config_updates": [], "resolved_config": None,
                                     "requests": entries}
        if crash and not bare:
            data["launch_command"] = ["python", "-m", "sglang.launch_server"]
        path.write_bytes(pickle.dumps(data, protocol=pickle.HIGHEST_PROTOCOL))
    return path


def log_line(obj: dict, out: dict, event: str = "request.finished", when: str = "2026-01-01T12:00:00") -> str:
    data = {"timestamp": when, "event": event, "rid": obj.get("rid"), "obj": obj, "out": out}
    return "[2026-01-01 12:00:00] " + json.dumps(data, ensure_ascii=False)


def write_lines(path: Path, records: list) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records), encoding="utf-8")
    return path
