"""The --data vocabulary is the registry's: docs/data.md's table lists exactly the registered kinds, with each
kind's provenance, and every `--data` help text is generated from the registry."""

from __future__ import annotations

import re
from pathlib import Path

from click.testing import CliRunner

from kimi_nvfp4.data.source_registry import DATA_SOURCES

DOC = Path(__file__).parents[2] / "docs" / "data.md"


def test_docs_table_matches_the_registry():
    rows = re.findall(r"^\| `([^`]+)`(?: or `[^`]+`)? \| ([a-z -]+) \|", DOC.read_text(), flags=re.M)
    assert {usage: tokens.strip() for usage, tokens in rows} == {s.usage: s.provenance for s in DATA_SOURCES.entries()}


def test_help_texts_list_every_registered_kind():
    from kimi_nvfp4.calibrate.cli import calibrate_command
    from kimi_nvfp4.validate.cli import validate_command

    for command in (calibrate_command, validate_command):
        text = " ".join(CliRunner().invoke(command, ["--help"], terminal_width=400).output.split())
        for source in DATA_SOURCES.entries():
            assert source.usage in text, (command.name, source.usage)
