"""`kimi-nvfp4 convert`: a thin click layer over `convert_checkpoint`; its options are `ConvertOptions`."""

from __future__ import annotations

import json

import click

from ..stage_options import cli_options
from .api import convert_checkpoint
from .options import ConvertOptions


@click.command("convert")
@click.argument("source")
@click.argument("output", type=click.Path(file_okay=False))
@cli_options(ConvertOptions)
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
@click.option("--no-progress", is_flag=True, help="Hide progress bars.")
def convert_command(source: str, output: str, options: ConvertOptions, as_json: bool, no_progress: bool) -> None:
    """Convert the INT4 Kimi K2.x checkpoint SOURCE (folder or Hub repo id) to NVFP4 in OUTPUT.

    Re-running the same command resumes and skips finished shards.
    """
    summary = convert_checkpoint(source, output, options, progress=not no_progress)
    if as_json:
        click.echo(json.dumps(summary.to_dict(), indent=2))
    else:
        for line in summary.lines():
            click.echo(line)
