"""`kimi-nvfp4 run` and `kimi-nvfp4 demo`: thin click layers over `run_pipeline` / `run_demo`."""

from __future__ import annotations

from pathlib import Path

import click

from ..errors import KimiNvfp4Error
from .summary import PipelineSummary, StageStatus


class PipelineFailed(KimiNvfp4Error):
    """A stage failed; carries that stage's exit code to the console entry point (kimi_nvfp4/cli.py `main`)."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


def _finish(summary: PipelineSummary) -> None:
    click.echo("")
    click.echo(summary.to_table())
    if summary.report_dir:
        click.echo(f"reports: {summary.report_dir}")
    if summary.exit_code:
        failed = next(s for s in summary.stages if s.status is StageStatus.FAILED)
        # Raised rather than ctx.exit(): the entry point runs click with standalone_mode=False, which turns
        # ctx.exit(n) into a return value that `main` does not pass on.
        raise PipelineFailed(f"stage {failed.name} failed (exit {summary.exit_code}): {failed.summary}",
                             summary.exit_code)


@click.command("run")
@click.argument("source")
@click.argument("output", type=click.Path(file_okay=False, path_type=Path))
@click.option("--config", "config_path", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="pipeline.toml: one section per stage ([convert], [calibrate], [requantize], [validate], "
                   "[serve_check], [publish]); see docs/pipeline.md.")
@click.option("--device", default=None, help="Default device for every stage (auto, cpu, cuda, cuda:N); "
                                             "overrides the config's top-level `device`.")
@click.option("--no-progress", is_flag=True, help="Hide progress bars.")
def run_command(source: str, output: Path, config_path: Path | None, device: str | None,
                no_progress: bool) -> None:
    """Run convert -> calibrate [-> requantize] -> validate [-> serve-check] [-> publish] from SOURCE into OUTPUT.

    A stage already finished with the same settings is skipped; the run stops at the first failing stage and
    exits with its code (1 gate failed, 3 bad checkpoint, 4 output problem, 5 device, 2 other).
    """
    from .config import load_pipeline_config
    from .runner import run_pipeline

    config = load_pipeline_config(config_path)
    if device is not None:
        config = config.model_copy(update={"device": device})
    _finish(run_pipeline(source, output, config, progress=not no_progress))


@click.command("demo")
@click.argument("directory", required=False, type=click.Path(file_okay=False, path_type=Path))
@click.option("--no-progress", is_flag=True, help="Hide progress bars.")
def demo_command(directory: Path | None, no_progress: bool) -> None:
    """Run the whole pipeline on the bundled tiny K2 model on CPU (a few minutes), into DIRECTORY
    (default ./kimi-nvfp4-demo): convert, calibrate, validate, serve-check against the reference server,
    and a publish dry run that writes the model card preview. Nothing is uploaded.
    """
    from .demo import run_demo

    _finish(run_demo(directory, progress=not no_progress))
