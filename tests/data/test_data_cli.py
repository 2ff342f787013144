"""`kimi-nvfp4 data sessions|stats` through click (the command group lives in kimi_nvfp4/data/cli.py)."""

from __future__ import annotations

import json

from click.testing import CliRunner

from kimi_nvfp4.data.cli import data_command
from kimi_nvfp4.data.loaders import load_jsonl


def test_help_lists_subcommands():
    result = CliRunner().invoke(data_command, ["--help"])
    assert result.exit_code == 0 and "sessions" in result.output and "stats" in result.output


def test_sessions_then_stats(tmp_path, kimi_tiktoken_dir):
    tree = tmp_path / "repo"
    tree.mkdir()
    (tree / "mod.py").write_text("def f(a, b):\n    c = a + b\n    return c\n\n\n"
                                 "def g(x):\n    y = f(x, x)\n    return y\n")
    out = tmp_path / "s.jsonl"
    result = CliRunner().invoke(data_command, ["sessions", "--tree", str(tree), "--out", str(out), "-n", "3",
                                               "--seed", "1"])
    assert result.exit_code == 0, result.output
    assert len(load_jsonl(out).conversations) == 3

    report = tmp_path / "stats.json"
    result = CliRunner().invoke(data_command, ["stats", "--data", f"jsonl:{out}", "--checkpoint",
                                               str(kimi_tiktoken_dir), "--seq-len", "256", "--json-out", str(report)])
    assert result.exit_code == 0, result.output
    stats = json.loads(report.read_text())
    assert stats["sources"][0]["conversations"] == 3
    assert stats["calibration"]["conversations"] + stats["heldout"]["conversations"] == 3
    assert stats["heldout"]["conversations"] >= 1 and stats["calibration"]["tokens"] > 0
