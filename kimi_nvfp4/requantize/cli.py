"""`kimi-nvfp4 requantize`: a thin click layer over `requantize_checkpoint`; its options are `RequantizeOptions`."""

from __future__ import annotations

import click

from ..stage_options import cli_options
from .options import RequantizeOptions


@click.command("requantize")
@click.argument("output", type=click.Path(exists=True, file_okay=False))
@click.option("--source", required=True, type=click.Path(exists=True, file_okay=False),
              help="The INT4 checkpoint OUTPUT was converted from (the reference the experts are quantized against).")
@cli_options(RequantizeOptions)
@click.option("--no-progress", is_flag=True, help="Hide progress bars.")
def requantize_command(output: str, source: str, options: RequantizeOptions, no_progress: bool) -> None:
    """Rewrite OUTPUT's routed-expert shards with an output-aware scale method (act-diag, gptq, gptq-w4a4,
    gptq-w4a4-diag).

    OUTPUT must be converted and calibrated with --expert-stats (diag for act-diag, hessian for gptq, w4a4 for
    gptq-w4a4 and gptq-w4a4-diag). Only the shards holding routed experts are rewritten (atomically, one at a time; a killed run
    resumes), then the input scales are recalibrated. validate again before publishing: the old verdict judged other bytes.
    """
    from .api import requantize_checkpoint

    result = requantize_checkpoint(output, source, options, progress=not no_progress)
    click.echo(f"requantized ({result.method}): {len(result.shards_rewritten)} shards rewritten, "
               f"{len(result.shards_skipped)} already done, recalibrated={result.recalibrated} "
               f"in {result.seconds:.1f} s; statistics used: {result.counts}")
