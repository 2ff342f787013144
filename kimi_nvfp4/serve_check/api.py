"""`run_serve_check`: launch (or attach to) a server, load it like coding agents do, smoke-test quality, report."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .. import __version__
from ..errors import GateFailure, KimiNvfp4Error
from .client import ChatClient
from .gpu_fit import GpuInfo, check_gpu_fit, checkpoint_weight_gib
from .launcher import DEFAULT_READY_TIMEOUT_S, ManagedServer, ServerLaunchError
from .load_fit import check_reference_fit
from .loadgen import LoadSweep, run_sweep_async
from .options import ServeCheckOptions
from .profiles import DEFAULT_HOST, DEFAULT_PORT, build_launch_command, get_profile
from .quality.agreement import AgreementSamples, collect_agreement_samples, score_agreement
from .quality.humaneval import run_humaneval
from .quality.tool_calls import run_tool_call_check
from .replay import ReplayConfig, ReplayReport, load_plan, run_replay_async
from .report import (Gates, QualityConfig, QualityReport, ServeCheckReport, TargetInfo, evaluate_gates,
                     summarise_checks, write_report)
from .workload import LoadConfig

SERVE_CHECK_STAGE = "serve_check"
# A comparison target runs only the load sweep.
_LOAD_ONLY = QualityConfig(humaneval=False, tool_calls=False, agreement=False)
URL_PROBE_TIMEOUT_S = 30.0
SERVER_INFO_KEYS = ("model_path", "served_model_name", "context_length", "max_total_num_tokens", "tp_size",
                    "dp_size", "quantization", "kv_cache_dtype", "disable_radix_cache", "moe_runner_backend",
                    "attention_backend", "version", "reference_emulator", "emulated_activations", "vocab_size")


def is_url(spec: str) -> bool:
    return spec.startswith(("http://", "https://"))


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def _get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=URL_PROBE_TIMEOUT_S) as r:
        return json.loads(r.read())


def probe_server(url: str) -> dict:
    """Server info of a running server (SGLang: /get_server_info, newer /server_info); fails clearly."""
    url = url.rstrip("/")
    try:
        _get_json(url + "/v1/models")
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise ServerLaunchError(f"no OpenAI-compatible server at {url} (GET /v1/models: {e})") from None
    for path in ("/get_server_info", "/server_info"):
        try:
            return _get_json(url + path)
        except (urllib.error.URLError, OSError, ValueError):
            continue
    return {}


@contextlib.contextmanager
def serving(checkpoint: str | Path, spec: str, report_dir: Path, *, extra_args: tuple[str, ...] = (),
            port: int = DEFAULT_PORT, ready_timeout_s: float = DEFAULT_READY_TIMEOUT_S,
            gpus: list[GpuInfo] | None = None) -> Iterator[TargetInfo]:
    """A ready server for `spec` (a URL, or a profile that is launched here and torn down on exit)."""
    if is_url(spec):
        info = probe_server(spec)
        yield TargetInfo(label=spec, url=spec.rstrip("/"), reference_emulator=bool(info.get("reference_emulator")),
                         server_info={k: info[k] for k in SERVER_INFO_KEYS if k in info})
        return
    profile = get_profile(spec)
    check_gpu_fit(profile, gpus, weight_gib=checkpoint_weight_gib(checkpoint))
    command = build_launch_command(profile, checkpoint, host=DEFAULT_HOST, port=port, extra_args=extra_args)
    url = f"http://{DEFAULT_HOST}:{port}"
    log = report_dir / f"sglang-{profile.name}.log"
    with ManagedServer(command, url, log, ready_timeout_s=ready_timeout_s) as server:
        ready_s = server.wait_ready()
        info = probe_server(url)
        yield TargetInfo(label=profile.name, url=url, profile=profile.name, command=command, log_path=str(log),
                         ready_s=ready_s, server_info={k: info[k] for k in SERVER_INFO_KEYS if k in info})


def _num_gpus(load: LoadConfig, target: TargetInfo) -> int:
    if load.num_gpus:
        return load.num_gpus
    if target.profile:
        return get_profile(target.profile).tp
    info = target.server_info
    return max(1, int(info.get("tp_size") or 1) * int(info.get("dp_size") or 1))


async def _quality(url: str, checkpoint: Path, cfg: QualityConfig) -> tuple[QualityReport, AgreementSamples | None]:
    """The checks that need the server; agreement only collects the server's side here."""
    report = QualityReport()
    samples = None
    async with ChatClient(url) as client:
        if cfg.tool_calls:
            try:  # the template's default thinking mode: models reason before they call
                report.tool_calls = await run_tool_call_check(client, suite=cfg.tool_call_suite,
                                                              max_tokens=cfg.tool_call_max_tokens,
                                                              limit=cfg.tool_call_limit)
            except Exception as e:  # recorded and gated: one broken check must not hide the others
                report.errors["tool_calls"] = f"{type(e).__name__}: {e}"
        if cfg.humaneval:
            try:
                # thinking off by default: the answer, not the reasoning, must fit max_tokens
                extra = {"chat_template_kwargs": {"thinking": cfg.humaneval_thinking}}
                report.humaneval = await run_humaneval(client, limit=cfg.humaneval_limit,
                                                       max_tokens=cfg.humaneval_max_tokens, extra=extra)
            except Exception as e:
                report.errors["humaneval"] = f"{type(e).__name__}: {e}"
        if cfg.agreement:
            try:
                samples = await collect_agreement_samples(client, checkpoint, limit=cfg.agreement_limit,
                                                          max_new_tokens=cfg.agreement_max_new_tokens)
            except Exception as e:
                report.errors["agreement"] = f"{type(e).__name__}: {e}"
    return report, samples


def _score_agreement(report: QualityReport, samples: AgreementSamples | None, checkpoint: Path,
                     cfg: QualityConfig, activations: str, progress: bool) -> None:
    """Runs after the server is torn down, so a GPU emulator does not compete with SGLang for memory."""
    if samples is None:
        return
    try:
        report.agreement = score_agreement(samples, checkpoint, activations=activations,
                                           device=cfg.agreement_device, progress=progress)
    except Exception as e:
        report.errors["agreement"] = f"{type(e).__name__}: {e}"


def run_serve_check(
    checkpoint: str | Path,
    options: ServeCheckOptions | None = None,
    *,
    report_dir: str | Path,
    gpus: list[GpuInfo] | None = None,
    progress: bool = True,
    **overrides: Any,
) -> ServeCheckReport:
    """Measure `checkpoint` served by SGLang (`profile`) or by a running server (`url`); write the report.

    `load=None` or an empty concurrency list skips the load sweep; `quality` chooses the smoke tests.
    `compare` (a profile or URL) is loaded with the same workload and drawn on the same chart.
    Returns the report (also written to `report_dir`); `report.passed` says whether every gate held.

    :param options: a `ServeCheckOptions` (serve_check/options.py: profile, url, compare, extra_args,
        compare_extra_args, port, ready_timeout_s, quick, load, quality); its fields may also be keywords.
    :param gpus: the GPUs to check a profile against (default: asked from nvidia-smi).
    """
    opts = ServeCheckOptions.build(options, overrides, "run_serve_check")
    profile, url, compare, load, quality = opts.profile, opts.url, opts.compare, opts.load, opts.quality
    replay = opts.replay
    extra_args, compare_extra_args = opts.extra_args, opts.compare_extra_args
    port, ready_timeout_s = opts.port, opts.ready_timeout_s
    if (profile is None) == (url is None):
        raise KimiNvfp4Error("give exactly one of a serving profile or the URL of a running server")
    for spec in (profile, compare):
        if spec is not None and not is_url(spec):
            get_profile(spec)  # a typo in --compare should fail now, not after the first sweep
    checkpoint = Path(checkpoint)
    report_dir = Path(report_dir)
    report_dir.mkdir(parents=True, exist_ok=True)
    started = _now()
    spec = url or profile
    # the recorded traffic is read (and any bad record refused) before a server is launched
    plan = load_plan(replay) if replay is not None else None
    with serving(checkpoint, spec, report_dir, extra_args=extra_args, port=port, ready_timeout_s=ready_timeout_s,
                 gpus=gpus) as target:
        if target.reference_emulator:  # a CPU emulator: size the work to it, or stop now
            check_reference_fit(target.url, target.server_info, load, quality)
        sweep = None
        if load is not None and load.concurrency:
            sweep = asyncio.run(run_sweep_async(target.url, load, label=target.label,
                                                num_gpus=_num_gpus(load, target), progress=progress))
        replayed = _replay(target, replay, load, plan, progress)
        activations = (quality.agreement_activations or (get_profile(profile).activations if profile else None)
                       or target.server_info.get("emulated_activations") or "w4a4")
        quality_report, samples = asyncio.run(_quality(target.url, checkpoint, quality))
    _score_agreement(quality_report, samples, checkpoint, quality, activations, progress)
    compare_target: TargetInfo | None = None
    compare_sweep: LoadSweep | None = None
    compare_replayed: ReplayReport | None = None
    if compare is not None and ((load is not None and load.concurrency) or replay is not None):
        with serving(checkpoint, compare, report_dir, extra_args=compare_extra_args, port=port,
                     ready_timeout_s=ready_timeout_s, gpus=gpus) as compare_target:
            if compare_target.reference_emulator:
                check_reference_fit(compare_target.url, compare_target.server_info, load, _LOAD_ONLY)
            if load is not None and load.concurrency:
                compare_sweep = asyncio.run(run_sweep_async(
                    compare_target.url, load, label=compare_target.label, num_gpus=_num_gpus(load, compare_target),
                    progress=progress))
            compare_replayed = _replay(compare_target, replay, load, plan, progress)
    gates = quality.gates or (Gates.reference() if target.reference_emulator else Gates.production())
    results = evaluate_gates(gates, sweep, quality_report, quality, target.reference_emulator, replayed)
    report = ServeCheckReport(
        tool_version=__version__, checkpoint=str(checkpoint), started_at=started, finished_at=_now(),
        target=target, load=sweep, compare_target=compare_target, compare=compare_sweep, replay=replayed,
        compare_replay=compare_replayed, quality=quality_report,
        checks=summarise_checks(sweep, quality_report, quality, target.reference_emulator, replayed),
        gates=results, passed=all(g.passed for g in results),
    )
    write_report(report, report_dir)
    _record_stage(checkpoint, report, report_dir, load, quality, compare, replay)
    return report


def _replay(target: TargetInfo, replay: ReplayConfig | None, load: LoadConfig | None, plan, progress: bool
            ) -> ReplayReport | None:
    if replay is None:
        return None
    gpus = _num_gpus(load or LoadConfig(), target)
    return asyncio.run(run_replay_async(target.url, replay, label=target.label, num_gpus=gpus, progress=progress,
                                        plan=plan))


def _record_stage(checkpoint: Path, report: ServeCheckReport, report_dir: Path, load: LoadConfig | None,
                  quality: QualityConfig, compare: str | None, replay: ReplayConfig | None = None) -> None:
    """Add `stages["serve_check"]` to the converted folder's manifest (skipped for folders without one).

    Setting keys are this stage's own (`server`, `load_config`, ...): the pipeline merges its keys
    (`profile`, `url`, ...) into the same record and compares only those."""
    from ..checkpoint.manifest import MANIFEST_NAME, StageRecord, load_manifest, save_manifest

    if not (checkpoint / MANIFEST_NAME).is_file():
        return
    manifest = load_manifest(checkpoint)
    manifest.stages[SERVE_CHECK_STAGE] = StageRecord(
        settings={"server": report.target.label, "compare_with": compare,
                  "load_config": load.model_dump() if load else None, "quality_config": quality.model_dump(),
                  **({"replay_config": replay.model_dump()} if replay else {})},
        complete=True,
        finished_at=report.finished_at,
        outputs={"passed": report.passed, "report": str(report_dir),
                 "failed_gates": [g.name for g in report.failed_gates()]},
    )
    save_manifest(checkpoint, manifest)


def raise_on_failure(report: ServeCheckReport) -> None:
    failed = report.failed_gates()
    if failed:
        what = "; ".join(f"{g.name}: crashed ({g.error})" if g.error else
                         f"{g.name} = {g.value if g.value is not None else 'not measured'} "
                         f"(needs {g.comparison} {g.threshold:g})" for g in failed)
        raise GateFailure(f"serve-check failed {len(failed)} gate(s): {what}")
