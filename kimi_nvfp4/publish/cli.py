"""`kimi-nvfp4 publish`: thin click layer over `publish_checkpoint`."""

from __future__ import annotations

from pathlib import Path

import click

from .files import format_size


@click.command("publish")
@click.argument("output", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.argument("repo_id")
@click.option("--private", is_flag=True, help="Create the repository as private.")
@click.option("--revision", default=None, help="Branch to upload to (created if missing); default main.")
@click.option("--dry-run", is_flag=True, help="List every file, its size and the model card; no network, no writes.")
@click.option("--force-unvalidated", is_flag=True,
              help="Publish although validate is missing or failed; the card says so. Shard checks still apply.")
@click.option("--report-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Where validate/serve-check wrote their reports (default: OUTPUT/reports, then the manifest).")
@click.option("--base-model", default=None,
              help="Hub id of the source model for the card (default: from the manifest).")
@click.option("--endpoint", default=None, help="Hub URL (default: HF_ENDPOINT or https://huggingface.co).")
@click.option("--workers", type=click.IntRange(1, 64), default=4, show_default=True,
              help="Threads hashing shards in parallel.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Also write the result (files, sizes, checks, commit) as JSON here.")
@click.option("--no-progress", is_flag=True, help="Hide progress bars.")
def publish_command(output: Path, repo_id: str, private: bool, revision: str | None, dry_run: bool,
                    force_unvalidated: bool, report_dir: Path | None, base_model: str | None, endpoint: str | None,
                    workers: int, json_path: Path | None, no_progress: bool) -> None:
    """Upload the converted, validated checkpoint OUTPUT to the Hub repository REPO_ID.

    Refuses (exit 3) unless the manifest shows every shard complete with matching sha256, and (exit 1) unless
    validate passed. The token comes from HF_TOKEN or `hf auth login` and is never printed or written.
    """
    from .api import publish_checkpoint, publish_result_json

    result = publish_checkpoint(output, repo_id, private=private, revision=revision, dry_run=dry_run,
                                force_unvalidated=force_unvalidated, report_dir=report_dir, base_model=base_model,
                                endpoint=endpoint, workers=workers, progress=not no_progress)
    if json_path is not None:
        json_path.write_text(publish_result_json(result) + "\n")
    if dry_run:
        click.echo(result.render_dry_run())
        return
    for note in result.notes + result.readiness.notes:
        click.echo(f"note: {note}", err=True)
    where = result.upload.commit_url or result.upload.repo_url
    click.echo(f"published {len(result.files)} files ({format_size(result.total_bytes)}) to {repo_id}: {where}")
