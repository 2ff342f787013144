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


# --- the one Device type (stage_kit/device_type.py) and a method's typed options (stage_kit/method_option.py) ---

DEVICE_OPTIONS = ["convert", "calibrate", "requantize", "validate"]


def _options_type(stage: str) -> type[StageOptions]:
    adapter = load_target(next(c for c in COMMANDS if c.name == stage).stage)
    return next(t for t in adapter.Section.__mro__[1:] if t.__name__.endswith("Options"))


@pytest.mark.parametrize("stage", DEVICE_OPTIONS)
def test_every_stage_takes_one_device_vocabulary(stage):
    import torch

    from kimi_nvfp4.stage_kit.device_type import DeviceParamType

    model = _options_type(stage)
    assert model(device="cuda:1").device == "cuda:1" and model(device=" CPU").device == "cpu"
    assert model(device=torch.device("cuda", 2)).device == "cuda:2"
    with pytest.raises(ValidationError, match="device must be auto, cpu, cuda or cuda:N, got 'tpu'"):
        model(device="tpu")
    param = next(p for p in load_target(next(c for c in COMMANDS if c.name == stage).target).params
                 if p.name == "device")
    assert isinstance(param.type, DeviceParamType)
    if "states_device" in model.model_fields:
        assert model(states_device=None).states_device is None and model(states_device="cpu").states_device == "cpu"
        with pytest.raises(ValidationError, match="states_device"):
            model(states_device="gpu")


def test_convert_cli_accepts_cuda_index_and_refuses_other_devices(tmp_path):
    """`--device cuda:1` passes the option (the machine then decides: exit 5 without CUDA, never a usage error);
    a device outside the vocabulary is a usage error naming the flag."""
    from kimi_nvfp4.cli import cli

    bad = CliRunner().invoke(cli, ["convert", str(tmp_path), str(tmp_path / "out"), "--device", "tpu"])
    assert bad.exit_code == 2 and "--device" in bad.output and "cuda:N" in bad.output
    good = CliRunner().invoke(cli, ["convert", str(tmp_path), str(tmp_path / "out"), "--device", "cuda:1"])
    assert good.exit_code != 2, good.output


def test_method_options_from_the_cli_are_typed_by_the_method(tmp_path):
    from kimi_nvfp4.requantize.options import RequantizeOptions
    from kimi_nvfp4.stage_options import options_from_cli

    pairs = ("damping=0.02", "block-columns=64")
    opts = options_from_cli(RequantizeOptions, {"method": "gptq", "method_options": pairs})
    assert opts.method_options == {"damping": 0.02, "block_columns": 64}  # the keys given, typed
    config = opts.method_config()
    assert (config.damping, config.block_columns, config.damping_retries) == (0.02, 64, 4)  # over the defaults
    assert opts.recorded()["method_options"] == config.model_dump(mode="json")
    with pytest.raises(click.BadParameter, match="act-diag: option damping") as e:
        options_from_cli(RequantizeOptions, {"method": "act-diag", "method_options": ("damping=0.02",)})
    assert e.value.param_hint == "--method-option"
    with pytest.raises(click.BadParameter, match="expected KEY=VALUE"):
        options_from_cli(RequantizeOptions, {"method": "gptq", "method_options": ("damping",)})


def test_method_options_in_pipeline_toml_and_the_api():
    from kimi_nvfp4.numerics.methods.catalog.gptq import GptqOptions
    from kimi_nvfp4.pipeline import pipeline_config_from_dict
    from kimi_nvfp4.pipeline.config import ConfigError
    from kimi_nvfp4.requantize.options import RequantizeOptions

    config = pipeline_config_from_dict({"requantize": {"method": "gptq", "method_options": {"shrinkage_scale": 4}}})
    assert config.section("requantize").method_options == {"shrinkage_scale": 4.0}
    assert config.to_toml_dict()["requantize"]["method_options"] == {"shrinkage_scale": 4.0}
    with pytest.raises(ConfigError, match="requantize.method_options: .*gptq: option colour"):
        pipeline_config_from_dict({"requantize": {"method_options": {"colour": 1}}})
    api = RequantizeOptions.build(None, {"method_options": GptqOptions(damping=0.1)}, "requantize_checkpoint")
    assert api.method_options == {"damping": 0.1}
    with pytest.raises(ValidationError, match="convert takes|int4-aware: option damping"):
        _options_type("convert")(method_options={"damping": 0.1})  # the weight-only methods take none


def test_help_lists_the_registered_methods_and_their_options():
    from kimi_nvfp4.cli import cli
    from kimi_nvfp4.numerics.methods import METHODS

    help_text = " ".join(CliRunner().invoke(cli, ["requantize", "--help"]).output.split())
    for spec in METHODS.entries():
        if not spec.weight_only:
            assert spec.name in help_text
    for key in ("damping=0.01", "shrinkage_scale=1.0", "energy_damping=0.01", "--method-option KEY=VALUE"):
        assert key in help_text
    convert_help = " ".join(CliRunner().invoke(cli, ["convert", "--help"]).output.split())
    assert "[amax|int4-aware|sweep]" in convert_help and "these methods take none" in convert_help
