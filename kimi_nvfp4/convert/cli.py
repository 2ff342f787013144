"""`kimi-nvfp4 convert`: a thin click layer over `convert_checkpoint`."""

from __future__ import annotations

import json

import click

from ..numerics.methods import DEFAULT_METHOD, weight_only_methods
from .api import DEVICES, KV_CACHE_CHOICES, convert_checkpoint


@click.command("convert")
@click.argument("source")
@click.argument("output", type=click.Path(file_okay=False))
@click.option("--method", type=click.Choice([m.value for m in weight_only_methods()]), default=DEFAULT_METHOD.value,
              show_default=True, help="How NVFP4 scales are chosen for each INT4 expert matrix.")
@click.option("--device", type=click.Choice(DEVICES), default="auto", show_default=True,
              help="Where experts are quantized; CPU and CUDA write identical bytes.")
@click.option("--workers", type=click.IntRange(min=1), default=1, show_default=True,
              help="Shards converted in parallel (memory: about two shards per worker).")
@click.option("--kv-cache", "kv_cache_quant_algo", type=click.Choice(KV_CACHE_CHOICES), default="FP8",
              show_default=True, help="KV-cache format declared in the quant config (NVIDIA ships K2.6 with FP8).")
@click.option("--overwrite", is_flag=True, help="Replace an earlier conversion made with other settings.")
@click.option("--revision", default=None, help="Hub revision when SOURCE is a repo id.")
@click.option("--stats/--no-stats", "record_stats", default=True, show_default=True,
              help="Record each matrix's error against its INT4 values in the manifest (same bytes; slower on CPU).")
@click.option("--fsync/--no-fsync", default=True, show_default=True,
              help="Flush each finished shard to disk before recording it. --no-fsync leaves write-back to the OS "
                   "(same bytes; faster where the disk is slower than the conversion): a killed run loses nothing, "
                   "and after an OS crash or reboot a resume re-checks such shards' sha256.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
@click.option("--no-progress", is_flag=True, help="Hide progress bars.")
def convert_command(
    source, output, method, device, workers, kv_cache_quant_algo, overwrite, revision, record_stats, fsync, as_json,
    no_progress,
):
    """Convert the INT4 Kimi K2.x checkpoint SOURCE (folder or Hub repo id) to NVFP4 in OUTPUT.

    Re-running the same command resumes and skips finished shards.
    """
    summary = convert_checkpoint(
        source, output, method=method, device=device, workers=workers, kv_cache_quant_algo=kv_cache_quant_algo,
        overwrite=overwrite, progress=not no_progress, revision=revision, record_stats=record_stats,
        fsync=fsync,
    )
    if as_json:
        click.echo(json.dumps(summary.to_dict(), indent=2))
    else:
        for line in summary.lines():
            click.echo(line)
