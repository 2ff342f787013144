"""Every command answers --help without importing the world, and unknown commands fail."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from kimi_nvfp4.cli import COMMANDS, cli


def test_top_level_help_lists_every_command():
    result = CliRunner().invoke(cli, ["--help"])
    assert result.exit_code == 0
    for name in COMMANDS:
        assert name in result.output


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_command_has_help(name):
    result = CliRunner().invoke(cli, [name, "--help"])
    assert result.exit_code == 0, result.output
    assert "Usage:" in result.output
    assert "--help" in result.output


def test_unknown_command_fails():
    result = CliRunner().invoke(cli, ["no-such-command"])
    assert result.exit_code != 0
