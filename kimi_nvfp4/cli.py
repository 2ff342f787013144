"""`kimi-nvfp4` command line: a thin click layer; each stage owns its command in `<stage>/cli.py`, and the
registry (kimi_nvfp4/registry.py) lists them.

Commands are imported lazily so `kimi-nvfp4 --help` stays fast and a stage's heavy imports
(torch, modelopt, aiohttp) load only when that stage runs.
"""

from __future__ import annotations

import os
import sys
import traceback

import click

from . import __version__
from .errors import KimiNvfp4Error, exit_code_for
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


# Commands that run data-parallel under torchrun (kimi_nvfp4.distributed).
DISTRIBUTED_COMMANDS = ("convert", "calibrate", "validate")
GPUS_OPTION = "--gpus"


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="kimi-nvfp4")
@click.option(
    GPUS_OPTION,
    type=click.IntRange(min=1),
    default=None,
    expose_value=False,
    help="Run the command on N local GPUs (calibrate, validate): launches `torchrun --nproc-per-node N -m "
    "kimi_nvfp4 COMMAND ...`. Must come before the command. Several nodes: run torchrun yourself.",
)
def cli() -> None:
    """Kimi K2.6 INT4 -> NVFP4 for SGLang on B200/B300, with calibration, validation and serving checks."""


def _split_gpus(args: list[str]) -> tuple[int | None, list[str]]:
    """`--gpus N COMMAND ...` (or `--gpus=N`) at the front -> (N, the rest); else (None, args)."""
    if args and args[0].startswith(GPUS_OPTION + "="):
        value, rest = args[0].split("=", 1)[1], args[1:]
    elif args[:1] == [GPUS_OPTION] and len(args) >= 2:
        value, rest = args[1], args[2:]
    else:
        return None, args
    try:
        return int(value), rest
    except ValueError:
        raise click.UsageError(f"{GPUS_OPTION} takes a number of GPUs, got {value!r}") from None


def _launch_distributed(gpus: int, rest: list[str]) -> int:
    """Run `rest` under torchrun on `gpus` local processes; its exit code (the first failing rank's)."""
    import os
    import subprocess

    from .distributed import ENV_WORLD_SIZE, torchrun_command

    if not rest or rest[0] not in DISTRIBUTED_COMMANDS:
        raise click.UsageError(f"{GPUS_OPTION} works with: {', '.join(DISTRIBUTED_COMMANDS)}")
    if gpus == 1 or os.environ.get(ENV_WORLD_SIZE):  # nothing to launch, or already under torchrun
        return -1
    return subprocess.call(torchrun_command(gpus, rest))


def _in_torchrun_job() -> bool:
    try:
        return int(os.environ.get("WORLD_SIZE", "1")) > 1
    except ValueError:
        return False


def _leave_job(*, wait_for_peers: bool) -> None:
    """distributed.shutdown (imported only under torchrun: it imports torch): without it rank 0 aborted with
    "terminate called without an active exception" at exit in some runs, after the work was done."""
    from .distributed import shutdown

    shutdown(wait_for_peers=wait_for_peers)


def main(argv: list[str] | None = None) -> None:
    """Console entry point: user-facing errors become one line on stderr and a distinct exit code; any other
    exception is a bug: its traceback, one line saying so, and exit 70 (errors.py `exit_code_for`)."""
    try:
        gpus, rest = _split_gpus(list(sys.argv[1:] if argv is None else argv))
        if gpus is not None:
            code = _launch_distributed(gpus, rest)
            if code >= 0:
                sys.exit(code)
            argv = rest
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    in_job = _in_torchrun_job()
    if in_job and os.environ.get("RANK", "0") != "0":
        # under torchrun every rank runs the command; rank 0 alone prints its summary (errors still reach stderr)
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - lives until the process exits
    try:
        try:
            # standalone_mode=False returns a command's ctx.exit(code) value instead of exiting.
            code = cli.main(args=argv, standalone_mode=False)
        except BaseException:
            if in_job:
                _leave_job(wait_for_peers=False)  # a failing rank must not wait at a barrier its peers never reach
            raise
        if in_job:
            _leave_job(wait_for_peers=True)
    except KimiNvfp4Error as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(exit_code_for(e))
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except Exception as e:  # noqa: BLE001 - every command maps a bug the same way
        traceback.print_exc(file=sys.stderr)
        click.echo(f"internal error (a bug in kimi-nvfp4; the traceback above helps a report): "
                   f"{type(e).__name__}: {e}", err=True)
        sys.exit(exit_code_for(e))
    sys.exit(code if isinstance(code, int) else 0)
