"""`Device`: the one type of every stage option that names a compute device (convert, calibrate, validate,
requantize, their `states_device`, the pipeline's top-level `device`, serve-check's reference emulator).

One vocabulary everywhere: `auto` (the first CUDA device if there is one, else the CPU), `cpu`, `cuda`, `cuda:N`.
The annotated type carries both forms of the rule: a pydantic validator (a `torch.device` given to a Python API
becomes its name; anything else is refused naming the vocabulary, exit 2 on the command line) and the click type
`@cli_options` uses (so `--device cuda:1` is accepted by every command that has the option). Whether the machine
has that device is decided when a stage runs (`stage_kit/device.py` `resolve_device`: a DeviceError, exit 5).
No torch import here: options models load with `--help`.
"""

from __future__ import annotations

import re
import sys
from typing import Annotated, Any

import click
from pydantic import BeforeValidator

from ..stage_options import Cli

__all__ = ["AUTO_DEVICE", "DEVICE_TYPES", "Device", "OptionalDevice", "device_name"]

AUTO_DEVICE = "auto"
# The device kinds every stage accepts (`cuda` may carry an index: `cuda:1`).
DEVICE_TYPES = ("cpu", "cuda")
_DEVICE = re.compile(r"(auto|cpu|cuda(:\d+)?)")
VOCABULARY = "auto, cpu, cuda or cuda:N"


def device_name(value: Any) -> str:
    """The option's value as the name the command line uses: `torch.device("cuda", 1)` -> "cuda:1", " CPU" ->
    "cpu"; a ValueError naming the vocabulary for anything else."""
    torch = sys.modules.get("torch")  # no torch loaded: the value cannot be a torch.device
    if torch is not None and isinstance(value, torch.device):
        value = str(value)
    if not isinstance(value, str) or not _DEVICE.fullmatch(value.strip().lower()):
        raise ValueError(f"device must be {VOCABULARY}, got {value!r}")
    return value.strip().lower()


def _optional_device_name(value: Any) -> str | None:
    return None if value is None else device_name(value)


class DeviceParamType(click.ParamType):
    """`--device` on the command line: the same rule as the options model, refused as a usage error (exit 2)."""

    name = "device"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        try:
            return device_name(value)
        except ValueError as e:
            self.fail(str(e), param, ctx)


_CLI = Cli(click_type=DeviceParamType(), metavar="auto|cpu|cuda[:N]")

Device = Annotated[str, BeforeValidator(device_name), _CLI]
# Where a stage may leave a device unset (None: "the stage's own choice", e.g. hidden states on the compute device).
OptionalDevice = Annotated[str | None, BeforeValidator(_optional_device_name), _CLI]
