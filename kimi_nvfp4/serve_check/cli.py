"""`kimi-nvfp4 serve-check` and `kimi-nvfp4 serve-reference`: thin click layers over the Python API."""

from __future__ import annotations

from pathlib import Path

import click

from .engine_worker import DEFAULT_MAX_PENDING
from .generation_jobs import DEFAULT_TIME_BUDGET_S
from .server_requests import DEFAULT_MAX_NEW_TOKENS_LIMIT
from .step_scheduler import DEFAULT_MAX_RUNNING
from ..stage_options import cli_options, options_from_cli
from .options import ServeCheckOptions
from .profiles import DEFAULT_PORT

GATE_CHOICES = ("auto", "production", "reference", "none")


def _int_list(ctx, param, value: str | None) -> list[int] | None:
    if value is None:
        return None
    try:
        return [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {value!r}") from None


@click.command("serve-check")
@click.argument("checkpoint", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--report", "report_dir", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="folder for serve_check.{json,md,png} and server logs")
@cli_options(ServeCheckOptions)
# The load sweep's and the quality checks' own fields (LoadConfig, QualityConfig), flattened to flags.
@click.option("--concurrency", callback=_int_list, help="concurrent sessions per point, e.g. 1,2,4,6,8,16,32")
@click.option("--sessions", type=int, help="sessions each user runs per point")
@click.option("--turns", type=int, help="requests per session")
@click.option("--input-tokens", type=int, help="mean prompt tokens per request")
@click.option("--output-tokens", type=int, help="output tokens per request")
@click.option("--tool-gap", type=float, help="seconds between a reply and the next turn")
@click.option("--point-timeout", type=float, help="wall-clock limit per concurrency point (s)")
@click.option("--request-timeout", type=float, help="limit per request (s)")
@click.option("--num-gpus", type=int, help="GPUs behind the server for per-GPU throughput (default: profile TP)")
@click.option("--no-load", is_flag=True, help="skip the load sweep")
@click.option("--replay", "replay_data", metavar="SPEC",
              help="replay recorded traffic as the load (sglang-dump:DIR, sglang-log:DIR, openai:FILE, ...): its "
                   "prompts, arrival times and output lengths; replaces the synthetic sweep unless --concurrency")
@click.option("--replay-speed", type=float, help="time compression of the replay (10: a day in 2.4 h)")
@click.option("--replay-concurrency", type=int, help="replayed requests in flight at most (default 64)")
@click.option("--replay-limit", type=int, help="replay the first N recorded requests by arrival")
@click.option("--replay-timeout", type=float, help="wall-clock limit of the whole replay (s)")
@click.option("--no-humaneval", is_flag=True, help="skip HumanEval")
@click.option("--humaneval-limit", type=int, help="first N HumanEval problems")
@click.option("--no-tool-calls", is_flag=True, help="skip the tool-call check")
@click.option("--no-agreement", is_flag=True, help="skip the emulator agreement check (it runs the model locally)")
@click.option("--agreement-device", default="cpu", show_default=True, help="device for the local emulator")
@click.option("--gates", type=click.Choice(GATE_CHOICES), default="auto", show_default=True,
              help="auto: reference gates for the reference server, production gates otherwise")
@click.option("--no-progress", is_flag=True, help="no progress bars")
def serve_check_command(checkpoint, report_dir, options: ServeCheckOptions, concurrency, sessions, turns,
                        input_tokens, output_tokens, tool_gap, point_timeout, request_timeout, num_gpus, no_load,
                        replay_data, replay_speed, replay_concurrency, replay_limit, replay_timeout, no_humaneval, humaneval_limit, no_tool_calls, no_agreement, agreement_device, gates,
                        no_progress):
    """Serve CHECKPOINT (launch SGLang with --profile, or attach with --url), load it with closed-loop
    coding-agent sessions across a concurrency sweep (or, with --replay, with recorded traffic at its own arrival
    times), run quality smoke tests, and write a report.

    Exit code 0 when every gate passes, 1 when one fails (the report says which), 5 when the GPUs do
    not fit the profile, 6 when the server fails to start.
    """
    from .api import raise_on_failure, run_serve_check
    from .report import Gates

    load = {k: v for k, v in dict(
        concurrency=concurrency, sessions_per_user=sessions, turns=turns, input_tokens=input_tokens,
        output_tokens=output_tokens, tool_gap_s=tool_gap, point_timeout_s=point_timeout,
        request_timeout_s=request_timeout, num_gpus=num_gpus).items() if v is not None}
    gate_set = {"auto": None, "production": Gates.production(), "reference": Gates.reference(),
                "none": Gates(max_load_error_rate=None)}[gates]
    quality = {k: v for k, v in dict(humaneval=not no_humaneval, tool_calls=not no_tool_calls,
                                     agreement=not no_agreement, humaneval_limit=humaneval_limit,
                                     agreement_device=agreement_device, gates=gate_set).items() if v is not None}
    # Tables of overrides: ServeCheckOptions starts them from the default or the --quick preset.
    replay = None
    if replay_data is not None:
        replay = {k: v for k, v in dict(data=replay_data, speed=replay_speed, concurrency=replay_concurrency,
                                        limit=replay_limit, timeout_s=replay_timeout,
                                        request_timeout_s=request_timeout).items() if v is not None}
        no_load = no_load or concurrency is None  # the team's traffic is the load test
    options = options_from_cli(ServeCheckOptions, {**dict(options), "load": None if no_load else load,
                                                   "replay": replay, "quality": quality})
    report = run_serve_check(checkpoint, options, report_dir=report_dir, progress=not no_progress)
    click.echo(f"serve-check {'passed' if report.passed else 'FAILED'}; report in {report_dir}/serve_check.md")
    raise_on_failure(report)


@click.command("serve-reference")
@click.argument("checkpoint", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=int, default=DEFAULT_PORT, show_default=True)
@click.option("--device", default="cpu", show_default=True, help="torch device for the emulator")
@click.option("--activations", type=click.Choice(["w4a4", "w4a16"]), default="w4a4", show_default=True,
              help="emulate Blackwell W4A4 or Hopper Marlin W4A16 experts")
@click.option("--prefix-cache-tokens", type=int, default=None, help="prefix cache budget in tokens")
@click.option("--model-name", default=None, help="served model name (default: folder name)")
@click.option("--max-queued-requests", type=click.IntRange(min=1), default=DEFAULT_MAX_PENDING, show_default=True,
              help="requests held at once (running + waiting); one more gets HTTP 503")
@click.option("--max-running-requests", type=click.IntRange(min=1), default=DEFAULT_MAX_RUNNING, show_default=True,
              help="requests generated at once, interleaved token by token (each holds its own KV cache)")
@click.option("--max-new-tokens-limit", type=click.IntRange(min=0), default=DEFAULT_MAX_NEW_TOKENS_LIMIT,
              show_default=True, help="cap on the tokens one request may generate; 0: the model's context")
@click.option("--request-time-budget", type=click.FloatRange(min=0), default=DEFAULT_TIME_BUDGET_S,
              show_default=True, help="wall seconds one generation may run before it ends as 'length'; 0: no budget")
def serve_reference_command(checkpoint, host, port, device, activations, prefix_cache_tokens, model_name,
                            max_queued_requests, max_running_requests, max_new_tokens_limit, request_time_budget):
    """Serve an NVFP4 CHECKPOINT through the reference emulator with the subset of SGLang's HTTP API
    that serve-check uses (chat completions with streaming, usage and cached tokens; /generate;
    /health_generate; /v1/models; /get_server_info). Slow but exact: for CI and for debugging a
    checkpoint on a machine without Blackwell GPUs. SIGTERM or Ctrl-C stops it, also mid-request
    (exit 0); a busy port exits 6.
    """
    from .engine import DEFAULT_PREFIX_CACHE_TOKENS, EmulatorEngine
    from .reference_server import serve_forever

    engine = EmulatorEngine(checkpoint, device=device, activations=activations, model_name=model_name,
                            prefix_cache_tokens=prefix_cache_tokens or DEFAULT_PREFIX_CACHE_TOKENS)
    click.echo(f"serving {checkpoint} ({activations}, {device}) on http://{host}:{port}", err=True)
    serve_forever(engine, host, port, max_pending=max_queued_requests, max_running=max_running_requests,
                  max_new_tokens_limit=max_new_tokens_limit or None, time_budget_s=request_time_budget or None)
    click.echo("serve-reference stopped", err=True)
