"""`kimi-nvfp4 check-engine`: a thin click layer over `check_engine`; exit 1 on any miss."""

from __future__ import annotations

import json

import click

from ..checkpoint.modelopt_config import ActivationScheme
from ..errors import GateFailure
from .api import DEVICES, check_engine
from .report import Engine
from .sglang_session import MOE_BACKEND_FOR_SCHEME, MOE_BACKENDS

_MISSES_SHOWN = 15


@click.command("check-engine")
@click.argument("output", type=click.Path(file_okay=False))
@click.option("--engine", type=click.Choice([e.value for e in Engine]), default=Engine.SGLANG.value, show_default=True,
              help="Whose loader to run (installed: pip install 'kimi-nvfp4[engines]', see docs/engine_check.md).")
@click.option("--device", type=click.Choice(DEVICES), default="auto", show_default=True,
              help="cpu: real values (sentinel audit, value checks); meta: shapes, routing and quant methods only; "
                   "auto: cpu up to 16 GiB of checkpoint, else meta.")
@click.option("--moe-runner-backend", type=click.Choice(MOE_BACKENDS), default=MOE_BACKEND_FOR_SCHEME, show_default=True,
              help="SGLang's MoE backend. for-scheme: SGLang's SM100 pick (flashinfer_trtllm) for a W4A4 checkpoint, "
                   "marlin for a weight-only one.")
@click.option("--full-size", is_flag=True,
              help="Write the config files and tensor listing of the full converted K2.6 (61 layers, 384 experts) "
                   "into OUTPUT and check them on the meta device (no shard is written).")
@click.option("--scheme", type=click.Choice([s.value for s in ActivationScheme]), default=ActivationScheme.W4A4.value,
              show_default=True, help="With --full-size: the activation scheme the configs declare.")
@click.option("--report", "report_dir", type=click.Path(file_okay=False), default=None,
              help="Folder for engine_check_<engine>.{json,md} (default: OUTPUT/reports).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def check_engine_command(output, engine, device, moe_runner_backend, full_size, scheme, report_dir, as_json):
    """Load the converted checkpoint OUTPUT with the serving engine's own code on this CPU and report every
    tensor not read, parameter not written, quant method that disagrees and value that differs.

    Exit 0 when clean, 1 on any miss, 3 for a bad checkpoint, 8 when the engine is not installed.
    """
    listing = None
    if full_size:
        from .full_size import write_full_size_checkpoint

        listing = write_full_size_checkpoint(output, scheme=ActivationScheme(scheme))
        device = "meta"
    report = check_engine(output, engine, device=device, moe_runner_backend=moe_runner_backend, listing=listing,
                          report_dir=report_dir)
    if as_json:
        click.echo(json.dumps(report.model_dump(mode="json"), indent=2))
    else:
        t = report.tensors
        click.echo(f"{report.engine.value} {report.engine_version} on {report.device.value}: {report.architecture}, "
                   f"declares {report.declared_scheme}; {', '.join(f'{k}: {v}' for k, v in report.settings.items())}")
        if t is not None:
            click.echo(f"tensors: {t.in_checkpoint} in checkpoint, {t.read} read, {t.routed} routed ({t.routing})")
        if report.parameters_total:
            click.echo(f"parameters: {report.parameters_written} of {report.parameters_total} fully written")
        click.echo(f"quant methods: {sum(report.modules.by_method.values())} modules, "
                   f"{len(report.modules.mismatches)} disagree with the checkpoint")
        for v in report.values:
            click.echo(f"  {'ok ' if v.passed else 'BAD'} {v.name}: {v.detail}")
        for m in report.misses[:_MISSES_SHOWN]:
            click.echo(f"miss: {m}")
        click.echo(f"patched for the CPU: {len(report.patches)} (see the report); {report.seconds:.1f} s")
    if not report.passed:
        raise GateFailure(f"{len(report.misses)} misses: the engine would not serve this checkpoint as written")
    click.echo("no miss")
