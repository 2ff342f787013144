"""Every registered command answers --help, the registry is the one list of commands, and unknown commands fail."""

from __future__ import annotations

import subprocess
import sys

import click
import pytest
from click.testing import CliRunner

from kimi_nvfp4.cli import cli
from kimi_nvfp4.registry import COMMANDS, load_target

NAMES = sorted(c.name for c in COMMANDS)


def test_top_level_help_lists_every_command_with_its_summary():
    result = CliRunner().invoke(cli, ["--help"], terminal_width=200, max_content_width=200)  # no wrapping
    assert result.exit_code == 0
    for command in COMMANDS:
        assert f"{command.name} {command.summary}" in " ".join(result.output.split())


@pytest.mark.parametrize("name", NAMES)
def test_every_command_has_help(name):
    result = CliRunner().invoke(cli, [name, "--help"])
    assert result.exit_code == 0, result.output
    assert "Usage:" in result.output
    assert "--help" in result.output


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c.name)
def test_each_entry_names_its_click_command(command):
    loaded = load_target(command.target)
    assert isinstance(loaded, click.Command) and loaded.name == command.name


@pytest.mark.parametrize("args", [["--help"], ["run", "--help"], ["demo", "--help"]], ids=" ".join)
def test_help_loads_no_stage_code(args):
    """`kimi-nvfp4 --help` (and `run --help`) stay fast: the registry holds strings, and the pipeline's names
    load lazily, so no stage module (nor torch) is imported."""
    code = ("import sys; from kimi_nvfp4.cli import main\n"
            f"try:\n    main({args!r})\nexcept SystemExit:\n    pass\n"
            "print(sorted(m for m in sys.modules if m.startswith('kimi_nvfp4.') or m == 'torch'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    loaded = out.strip().splitlines()[-1]
    assert "torch" not in loaded and "kimi_nvfp4.convert" not in loaded and "kimi_nvfp4.calibrate" not in loaded


def test_unknown_command_fails():
    result = CliRunner().invoke(cli, ["no-such-command"])
    assert result.exit_code != 0
