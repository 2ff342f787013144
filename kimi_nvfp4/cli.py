"""`kimi-nvfp4` command line: a thin click layer; each stage owns its command in `<stage>/cli.py`, and the
registry (kimi_nvfp4/registry.py) lists them.

Commands are imported lazily so `kimi-nvfp4 --help` stays fast and a stage's heavy imports
(torch, modelopt, aiohttp) load only when that stage runs.
"""

from __future__ import annotations

import sys

import click

from . import __version__
from .errors import KimiNvfp4Error
from .registry import COMMANDS, find_command, load_target


class LazyGroup(click.Group):
    """Commands from the registry (kimi_nvfp4/registry.py), each imported only when it runs."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(c.name for c in COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        command = find_command(name)
        return load_target(command.target) if command is not None else None

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [(c.name, c.summary) for c in sorted(COMMANDS, key=lambda c: c.name)]
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
