"""One options model per stage: the same fields are the command's flags, pipeline.toml's keys and the Python
API's keywords."""

from __future__ import annotations

import enum
from typing import Annotated

import click
import pytest
from click.testing import CliRunner
from pydantic import Field, ValidationError

from kimi_nvfp4.registry import COMMANDS, load_target
from kimi_nvfp4.stage_options import Cli, StageOptions, cli_fields, cli_options


class Color(str, enum.Enum):
    RED = "red"
    BLUE = "blue"


class ToyOptions(StageOptions):
    color: Color = Field(Color.RED, description="a choice")
    count: int = Field(2, ge=1, description="a bounded int")
    fast: bool = Field(False, description="a flag")
    check: Annotated[bool, Cli("--verify/--no-verify")] = Field(True, description="a switch")
    tags: list[str] = Field(default_factory=list, description="repeatable")
    note: Annotated[str | None, Cli("--comment")] = Field(None, description="renamed")
    hidden: Annotated[dict | None, Cli(hidden=True)] = None


@click.command("toy")
@cli_options(ToyOptions)
def toy_command(options: ToyOptions) -> None:
    click.echo(options.model_dump_json())


def _run(*args: str) -> ToyOptions:
    result = CliRunner().invoke(toy_command, list(args))
    assert result.exit_code == 0, result.output
    return ToyOptions.model_validate_json(result.output)


def test_defaults_flags_and_renames_come_from_the_model():
    assert _run() == ToyOptions()
    got = _run("--color", "blue", "--count", "5", "--fast", "--no-verify", "--tags", "a", "--tags", "b",
               "--comment", "hi")
    assert got == ToyOptions(color=Color.BLUE, count=5, fast=True, check=False, tags=["a", "b"], note="hi")
    help_text = CliRunner().invoke(toy_command, ["--help"]).output
    for line in ("[red|blue]", "a bounded int", "--verify / --no-verify", "--comment TEXT"):
        assert line in help_text
    assert "--hidden" not in help_text and cli_fields(ToyOptions)[-1] == "note"


@pytest.mark.parametrize("args, flag", [(["--count", "0"], "--count"), (["--color", "green"], "--color")])
def test_bad_values_are_usage_errors_naming_the_flag(args, flag):
    result = CliRunner().invoke(toy_command, args)
    assert result.exit_code == 2 and flag in result.output


def test_build_takes_a_model_keywords_or_both():
    base = ToyOptions(count=3)
    assert ToyOptions.build(None, {"count": 4}, "f") == ToyOptions(count=4)
    assert ToyOptions.build(base, {}, "f") is base
    assert ToyOptions.build(base, {"fast": True}, "f") == ToyOptions(count=3, fast=True)
    with pytest.raises(TypeError, match="f\\(\\) got an unexpected keyword argument 'colour'"):
        ToyOptions.build(None, {"colour": "red"}, "f")
    with pytest.raises(ValidationError, match="count"):
        ToyOptions.build(None, {"count": 0}, "f")
    with pytest.raises(TypeError, match="options must be ToyOptions"):
        ToyOptions.build({"count": 1}, {}, "f")  # type: ignore[arg-type]


@pytest.mark.parametrize("command", [c for c in COMMANDS if c.stage], ids=lambda c: c.name)
def test_every_stage_command_offers_its_options_models_fields_with_their_help(command):
    """The command's flags are generated from the same model its pipeline section is built on."""
    adapter = load_target(command.stage)
    options_type = next(t for t in adapter.Section.__mro__[1:] if t.__name__.endswith("Options"))
    params = {p.name: p for p in load_target(command.target).params}
    for name in cli_fields(options_type):
        assert name in params, f"{command.name}: no flag for {options_type.__name__}.{name}"
        assert params[name].help == options_type.model_fields[name].description
