"""`kimi-nvfp4` command line: a thin click layer; each stage owns its command in `<stage>/cli.py`.

Commands are imported lazily so `kimi-nvfp4 --help` stays fast and a stage's heavy imports
(torch, modelopt, aiohttp) load only when that stage runs.
"""

from __future__ import annotations

import importlib
import sys

import click

from . import __version__
from .errors import KimiNvfp4Error

# command name -> "module:attribute" of a click.Command
COMMANDS: dict[str, str] = {
    "convert": "kimi_nvfp4.convert.cli:convert_command",
    "synth": "kimi_nvfp4.synth.cli:synth_command",
    "calibrate": "kimi_nvfp4.calibrate.cli:calibrate_command",
    "validate": "kimi_nvfp4.validate.cli:validate_command",
    "serve-check": "kimi_nvfp4.serve_check.cli:serve_check_command",
    "serve-reference": "kimi_nvfp4.serve_check.cli:serve_reference_command",
    "publish": "kimi_nvfp4.publish.cli:publish_command",
    "run": "kimi_nvfp4.pipeline.cli:run_command",
    "demo": "kimi_nvfp4.pipeline.cli:demo_command",
    "build-demo-model": "kimi_nvfp4.demo_model.cli:build_demo_model_command",
    "data": "kimi_nvfp4.data.cli:data_command",
    "check-engine": "kimi_nvfp4.engine_check.cli:check_engine_command",
}

_SHORT_HELP = {
    "convert": "Convert an INT4 Kimi K2.x checkpoint to NVFP4 (ModelOpt HF format).",
    "synth": "Write a synthetic K2.6-layout INT4 checkpoint (tests, benchmarks).",
    "calibrate": "Write static activation scales (input_scale) from coding-agent sessions.",
    "validate": "Compare the NVFP4 checkpoint with its INT4 source; exit 1 if a gate fails.",
    "serve-check": "Serve the checkpoint with SGLang and measure it under coding-agent load.",
    "serve-reference": "Serve a checkpoint through the reference emulator (SGLang's HTTP subset).",
    "publish": "Upload a converted, validated checkpoint to the Hugging Face Hub.",
    "run": "Run convert -> calibrate -> validate [-> serve-check] [-> publish].",
    "demo": "Run the whole pipeline on the bundled tiny K2 model on CPU.",
    "build-demo-model": "Train and export the bundled tiny K2 checkpoint (reproducible).",
    "data": "Generate, inspect and split coding-agent session data.",
    "check-engine": "Load the checkpoint with SGLang's (or vLLM's) own code on CPU; exit 1 on any miss.",
}


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        target = COMMANDS.get(name)
        if target is None:
            return None
        module_name, attr = target.split(":")
        return getattr(importlib.import_module(module_name), attr)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [(name, _SHORT_HELP.get(name, "")) for name in self.list_commands(ctx)]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="kimi-nvfp4")
def cli() -> None:
    """Kimi K2.6 INT4 -> NVFP4 for SGLang on B200/B300, with calibration, validation and serving checks."""


def main(argv: list[str] | None = None) -> None:
    """Console entry point: user-facing errors become one line on stderr and a distinct exit code."""
    try:
        # standalone_mode=False returns a command's ctx.exit(code) value instead of exiting.
        code = cli.main(args=argv, standalone_mode=False)
    except KimiNvfp4Error as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(e.exit_code)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    sys.exit(code if isinstance(code, int) else 0)
