"""Calibrating on served traffic: every file the run writes holds counts and hashes only, never a prompt's text or
its token ids (issue #27 "Privacy"); and bad traffic stops before any layer runs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from kimi_nvfp4.calibrate import calibrate_checkpoint
from kimi_nvfp4.data.errors import DataError
from kimi_nvfp4.data.tokenizer import load_tokenizer

sys.path.insert(0, str(Path(__file__).parents[1] / "data"))
from traffic_fixtures import entry, write_dump  # noqa: E402

CANARY = "zebra-canary-7731 secret plan for the quarterly migration"


def _traffic(folder: Path, tokenizer, n: int = 12) -> list[list[int]]:
    sp = tokenizer.special_ids
    prompts = []
    for i in range(n):
        # longer than the 32-token windows asked for: a shorter request gives no full window (data/window_pick.py)
        text = f"{CANARY} number {i}; {CANARY} again, {CANARY} once more"
        ids = [sp["<|im_user|>"], *tokenizer.encode(text, allow_special=False), sp["<|im_end|>"]]
        prompts.append(ids)
    write_dump(folder / "2026-01-01_12-00-00.pkl", [entry(p, p[:5], t=i) for i, p in enumerate(prompts)])
    return prompts


def _written_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and p.suffix != ".safetensors"]


def test_no_written_file_holds_prompt_text_or_ids(converted_pair, tmp_path):
    src, out = converted_pair
    tokenizer = load_tokenizer(out)
    prompts = _traffic(tmp_path / "dumps", tokenizer)
    before = {p: p.stat().st_mtime_ns for p in _written_files(out)}
    report = calibrate_checkpoint(out, src, f"sglang-dump:{tmp_path / 'dumps'}", samples=8, seq_len=32,
                                  device="cpu", progress=False)
    assert report.sequences > 0
    written = [p for p in _written_files(out) if before.get(p) != p.stat().st_mtime_ns]
    assert written  # the manifest and the report at least
    id_runs = [json.dumps(p[1:9])[1:-1] for p in prompts] + [", ".join(map(str, p[1:9])) for p in prompts]
    for path in written:
        text = path.read_bytes().decode("utf-8", errors="replace")
        assert "zebra-canary" not in text, path
        for run in id_runs:
            assert run not in text, (path, run)


def test_ids_outside_the_vocabulary_stop_before_any_layer(converted_pair, tmp_path):
    src, out = converted_pair
    write_dump(tmp_path / "d" / "x.pkl", [entry([1, 2, 10**6 + i], [3], t=i) for i in range(8)])
    before = {p: p.stat().st_mtime_ns for p in _written_files(out)}
    with pytest.raises(DataError, match="outside this checkpoint's vocabulary") as e:
        calibrate_checkpoint(out, src, f"sglang-dump:{tmp_path / 'd'}", samples=4, seq_len=32, device="cpu",
                             progress=False)
    assert e.value.exit_code == 9
    after = {p: p.stat().st_mtime_ns for p in _written_files(out)}
    lock = out / ".kimi_nvfp4.lock"  # the output lock is taken (and released) before the data is read
    assert {p: t for p, t in after.items() if p != lock} == {p: t for p, t in before.items() if p != lock}
