"""`kimi-nvfp4 publish`: thin click layer over `publish_checkpoint`; its options are `PublishOptions`."""

from __future__ import annotations

from pathlib import Path

import click

from ..stage_options import cli_options
from .files import format_size
from .options import PublishOptions


@click.command("publish")
@click.argument("output", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.argument("repo_id")
@cli_options(PublishOptions)
@click.option("--report-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Where validate/serve-check wrote their reports (default: OUTPUT/reports, then the manifest).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Also write the result (files, sizes, checks, commit) as JSON here.")
@click.option("--no-progress", is_flag=True, help="Hide progress bars.")
def publish_command(output: Path, repo_id: str, options: PublishOptions, report_dir: Path | None,
                    json_path: Path | None, no_progress: bool) -> None:
    """Upload the converted, validated checkpoint OUTPUT to the Hub repository REPO_ID.

    Refuses (exit 3) unless the manifest shows every shard complete with matching sha256, and (exit 1) unless
    validate passed. The token comes from HF_TOKEN or `hf auth login` and is never printed or written.
    """
    from ..checkpoint.writer import write_text_atomic
    from ..stage_kit.output_paths import require_writable_file
    from .api import publish_checkpoint, publish_result_json

    if json_path is not None:  # before the upload: a bad path must not cost the "published" line and the commit URL
        require_writable_file(json_path, what="--json")
    result = publish_checkpoint(output, repo_id, options, report_dir=report_dir, progress=not no_progress)
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(json_path, publish_result_json(result) + "\n")
    if options.dry_run:
        click.echo(result.render_dry_run())
        return
    for note in result.notes + result.readiness.notes:
        click.echo(f"note: {note}", err=True)
    where = result.upload.commit_url or result.upload.repo_url
    click.echo(f"published {len(result.files)} files ({format_size(result.total_bytes)}) to {repo_id}: {where}")
