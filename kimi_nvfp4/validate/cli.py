"""`kimi-nvfp4 validate`: a thin click layer over `validate_checkpoint` (its options are `ValidateOptions`);
exit 1 when a gate fails."""

from __future__ import annotations

import click

from ..data.spec_option import data_option

from ..errors import GateFailure
from ..stage_options import cli_options
from .options import ValidateOptions


@click.command("validate")
@click.argument("output", type=click.Path(exists=True, file_okay=False))
@click.option(
    "--source",
    required=True,
    type=click.Path(exists=True, file_okay=False),
    help="The INT4 checkpoint OUTPUT was converted from.",
)
@data_option("Data (same spec as calibrate); only the held-out part is used.")
@click.option(
    "--report",
    "report_dir",
    required=True,
    type=click.Path(file_okay=False),
    help="Folder for validate_report.{json,md} and the PNG plots.",
)
@cli_options(ValidateOptions)
@click.option("--dry-run", is_flag=True,
              help="Print the memory plan as JSON and exit 0, reading only OUTPUT's config (no weights, no data): "
                   "for --samples x --seq-len tokens per torchrun rank, on --device even where it is absent "
                   "(--device cuda --gpu-memory 80GiB sizes a job for an 80 GB GPU).")
@click.option("--no-progress", is_flag=True, help="Hide progress bars.")
def validate_command(
    output: str, source: str, data: str, report_dir: str, options: ValidateOptions, dry_run: bool, no_progress: bool
) -> None:
    """Run the INT4 SOURCE and the NVFP4 OUTPUT side by side on held-out sessions; exit 0 only if every gate passes.

    Exit codes: 0 all gates pass, 1 a gate failed (the report says which and by how much), 2-5 bad input
    (see kimi-nvfp4 --help).
    """
    if dry_run:
        from .memory import plan_validation

        click.echo(plan_validation(output, options).model_dump_json(indent=2))
        return
    from .api import validate_checkpoint

    report = validate_checkpoint(output, source, data, options, report_dir=report_dir, progress=not no_progress)
    for g in report.gates:
        if not g.passed:
            click.echo(
                f"FAIL {g.name}: {g.value if g.value is not None else ''} {g.comparison} "
                f"{'' if g.threshold is None else g.threshold} {g.detail}".rstrip(),
                err=True,
            )
    click.echo(f"report: {report_dir}/validate_report.md")
    if not report.passed:
        failed = [g.name for g in report.failed_gates()]
        raise GateFailure(f"{len(failed)} of {len(report.gates)} gates failed: {', '.join(failed[:8])}")
    click.echo(f"all {len(report.gates)} gates passed")
