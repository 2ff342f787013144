"""`kimi-nvfp4 calibrate`: a thin click layer over `calibrate_checkpoint`; its options are `CalibrateOptions`."""

from __future__ import annotations

import click

from ..data.spec_option import data_option
from ..stage_options import cli_options
from .options import CalibrateOptions


@click.command("calibrate")
@click.argument("output", type=click.Path(exists=True, file_okay=False))
@click.option(
    "--source",
    required=True,
    type=click.Path(exists=True, file_okay=False),
    help="The INT4 checkpoint OUTPUT was converted from (checked against it).",
)
@data_option("Calibration data; the held-out part is never used here.")
@cli_options(CalibrateOptions)
@click.option(
    "--report-dir",
    default=None,
    type=click.Path(file_okay=False),
    help="Where the report goes (default OUTPUT/calibration).",
)
@click.option("--dry-run", is_flag=True,
              help="Print the memory plan as JSON and exit 0, reading only OUTPUT's config (no weights, no data): "
                   "for --samples x --seq-len tokens per torchrun rank, on --device even where it is absent "
                   "(--device cuda --gpu-memory 80GiB sizes a job for an 80 GB GPU).")
@click.option("--no-progress", is_flag=True, help="Hide progress bars.")
def calibrate_command(
    output: str, source: str, data: str, options: CalibrateOptions, report_dir: str | None, dry_run: bool,
    no_progress: bool,
) -> None:
    """Write input_scale for every NVFP4 linear of OUTPUT from coding-agent sessions.

    Adds model-input-scales.safetensors, updates the index and the manifest; the main shards are not
    rewritten. Writes a calibration report (JSON, Markdown, PNG) to OUTPUT/calibration.
    """
    if dry_run:
        from .memory import plan_calibration

        click.echo(plan_calibration(output, options).model_dump_json(indent=2))
        return
    from .api import calibrate_checkpoint

    report = calibrate_checkpoint(output, source, data, options, report_dir=report_dir, progress=not no_progress)
    click.echo(
        f"calibrated {report.input_scales} input scales from {report.sequences} sequences "
        f"({report.tokens} tokens, {report.settings.dtype}) in {report.seconds:.1f} s -> {report.shard}"
    )
