"""Fixtures for calibrate tests: a tiny INT4 source converted to NVFP4, and session files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from kimi_nvfp4.convert.api import convert_checkpoint
from kimi_nvfp4.synth import create_synthetic_checkpoint


def _convert_pair(root: Path, **synth) -> tuple[Path, Path]:
    src = create_synthetic_checkpoint(root / "src", preset="tiny", **synth)
    out = root / "out"
    convert_checkpoint(src, out, device="cpu", progress=False)
    return src, out


@pytest.fixture(scope="session")
def _converted_master(tmp_path_factory) -> tuple[Path, Path]:
    return _convert_pair(tmp_path_factory.mktemp("converted"), shards=2)


@pytest.fixture
def converted_pair(tmp_path, _converted_master) -> tuple[Path, Path]:
    """(INT4 source, private copy of its NVFP4 conversion without input scales)."""
    src, out = _converted_master
    dst = tmp_path / "out"
    shutil.copytree(out, dst)
    return src, dst


def session(i: int, turns: int = 1) -> dict:
    messages = [{"role": "system", "content": "You are a coding agent."}]
    for t in range(turns):
        messages += [
            {"role": "user", "content": f"Fix bug {i}.{t} in module_{i}.py please."},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": f"functions.read:{t}",
                        "type": "function",
                        "function": {"name": "read", "arguments": json.dumps({"path": f"m{i}.py"})},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": f"functions.read:{t}", "content": f"def f_{i}():\n    return {i} + {t}\n"},
            {"role": "assistant", "content": f"Done: changed line {t} of module_{i}."},
        ]
    return {"id": f"s{i}", "messages": messages}


@pytest.fixture
def sessions_jsonl(tmp_path) -> Path:
    path = tmp_path / "sessions.jsonl"
    path.write_text("".join(json.dumps(session(i, turns=1 + i % 3)) + "\n" for i in range(12)))
    return path
