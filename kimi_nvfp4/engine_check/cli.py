"""`kimi-nvfp4 check-engine`: a thin click layer over `check_engine`; exit 1 on any miss."""

from __future__ import annotations

import json

import click

from ..checkpoint.modelopt_config import ActivationScheme
from ..errors import GateFailure, KimiNvfp4Error
from ..plugins import PluginError, parse_option_pairs
from .api import DEVICES, check_engine
from .engine_registry import DEFAULT_ENGINE, ENGINES
from .report import COVERAGE_MEANING

_MISSES_SHOWN = 15


def _engine_help() -> str:
    lines = [f"{e.name} ({e.coverage.value} check): {COVERAGE_MEANING[e.coverage]}" for e in ENGINES.entries()]
    return "Whose code to run. " + "; ".join(lines) + ". Install: pip install 'kimi-nvfp4[engines]' (docs/engine_check.md)."


@click.command("check-engine")
@click.argument("output", type=click.Path(file_okay=False))
@click.option("--engine", type=click.Choice(ENGINES.names()), default=DEFAULT_ENGINE, show_default=True,
              help=_engine_help())
@click.option("--engine-option", "engine_options", multiple=True, metavar="KEY=VALUE",
              help="An option of the chosen engine (repeatable); sglang: moe_runner_backend.")
@click.option("--device", type=click.Choice(DEVICES), default="auto", show_default=True,
              help="cpu: real values (sentinel audit, value checks); meta: shapes, routing and quant methods only; "
                   "auto: cpu up to 16 GiB of checkpoint, else meta.")
@click.option("--moe-runner-backend", default=None,
              help="SGLang only, shorthand for --engine-option moe_runner_backend=...: for-scheme (default: SGLang's "
                   "SM100 pick, flashinfer_trtllm, for what SGLang parses as W4A4, marlin for weight-only), auto, "
                   "flashinfer_trtllm, flashinfer_cutlass, marlin.")
@click.option("--full-size", is_flag=True,
              help="Write the config files and tensor listing of the full converted K2.6 (61 layers, 384 experts) "
                   "into OUTPUT and check them on the meta device (no shard is written).")
@click.option("--scheme", type=click.Choice([s.value for s in ActivationScheme]), default=ActivationScheme.W4A4.value,
              show_default=True, help="With --full-size: the activation scheme the configs declare.")
@click.option("--report", "report_dir", type=click.Path(file_okay=False), default=None,
              help="Folder for engine_check_<engine>.{json,md} (default: OUTPUT/reports).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def check_engine_command(output, engine, engine_options, device, moe_runner_backend, full_size, scheme, report_dir,
                         as_json):
    """Load the converted checkpoint OUTPUT with the serving engine's own code on this CPU and report every
    tensor not read, parameter not written, quant method that disagrees and value that differs.

    SGLang runs its own weight loaders (a loader check). vLLM's wheel cannot build its model on a CPU, so its
    check runs only vLLM's config parsing, name mapping and exclusion rules (a rules check): it cannot see a
    renamed, missing, transposed or mistyped tensor, and its pass reads "PASS (rules only)".

    Exit 0 when clean, 1 on any miss, 3 for a bad checkpoint, 8 when the engine is not installed, 9 when the
    engine's process died without an answer.
    """
    try:
        options = parse_option_pairs(engine_options)
    except PluginError as e:
        raise KimiNvfp4Error(str(e)) from None
    listing = None
    if full_size:
        from .full_size import write_full_size_checkpoint

        listing = write_full_size_checkpoint(output, scheme=ActivationScheme(scheme))
        device = "meta"
    report = check_engine(output, engine, device=device, moe_runner_backend=moe_runner_backend, options=options,
                          listing=listing, report_dir=report_dir)
    if as_json:
        click.echo(json.dumps(report.model_dump(mode="json"), indent=2))
    else:
        t = report.tensors
        click.echo(f"{report.engine} {report.engine_version} on {report.device.value} ({report.coverage.value} check): "
                   f"{report.architecture}, declares {report.declared_scheme}; "
                   f"{', '.join(f'{k}: {v}' for k, v in report.settings.items())}")
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
    click.echo(report.verdict)
