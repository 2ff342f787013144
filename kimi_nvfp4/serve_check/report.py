"""The serve-check report: pydantic models, gates, and the Markdown rendering.

Gates have two default sets. `Gates.production()` is for real SGLang runs of Kimi K2.6 (thresholds
explained in docs/serve_check.md); `Gates.reference()` is for the reference emulator, where the
model is usually the tiny demo one: only the checks a tiny model can pass are gated (the server
and the emulator must agree; no request may fail).

Every check says what it is judged against (`CheckKind`): HumanEval's tests and the tools' JSON
schemas are independent of our code; agreement is independent against SGLang but only
self-consistency against the reference emulator (the same weights through two of our code paths:
it catches serving bugs, not conversion errors); the load sweep is operational. A check that was
asked for and crashed is a failed gate, gated or not: "All gates passed" means every check ran.
"""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from ..checkpoint.writer import write_bytes_atomic

from .loadgen import LoadSweep
from .quality.agreement import AgreementReport
from .quality.humaneval import HumanEvalReport
from .quality.tool_calls import ToolCallReport
from .replay import ReplayReport

REPORT_STEM = "serve_check"


class CheckKind(str, Enum):
    """What a check compares the served model with."""

    INDEPENDENT = "independent"  # something outside our code: a benchmark's tests, schemas, SGLang's kernels
    SELF_CONSISTENCY = "self-consistency"  # our emulator against itself (the reference server)
    OPERATIONAL = "operational"  # the server keeps serving; nothing is compared


CHECK_LABELS = {"load": "load sweep", "replay": "traffic replay", "humaneval": "HumanEval",
                "tool_calls": "tool calls", "agreement": "emulator agreement"}


def check_kind(check: str, reference_emulator: bool) -> tuple[CheckKind, str]:
    """(kind, what the check is compared with) for a check name of CHECK_LABELS."""
    if check in ("load", "replay"):
        return CheckKind.OPERATIONAL, "nothing: every request must succeed"
    if check == "humaneval":
        return CheckKind.INDEPENDENT, "HumanEval's unit tests"
    if check == "tool_calls":
        return CheckKind.INDEPENDENT, "the declared tools' JSON schemas"
    if reference_emulator:
        return CheckKind.SELF_CONSISTENCY, ("the same emulator and weights through another code path "
                                            "(KV-cached serving vs layer-streamed teacher forcing)")
    return CheckKind.INDEPENDENT, "the kimi-nvfp4 emulator, independent of the server's kernels"


class Gates(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_load_error_rate: float | None = 0.0
    min_humaneval_pass_at_1: float | None = None
    min_tool_trigger_rate: float | None = None
    min_tool_schema_accuracy: float | None = None
    min_greedy_agreement: float | None = None
    max_mean_abs_logprob_diff: float | None = None

    @classmethod
    def production(cls) -> Gates:
        return cls(max_load_error_rate=0.01, min_humaneval_pass_at_1=0.80, min_tool_trigger_rate=0.90,
                   min_tool_schema_accuracy=0.95, min_greedy_agreement=0.80, max_mean_abs_logprob_diff=0.25)

    @classmethod
    def reference(cls) -> Gates:
        return cls(max_load_error_rate=0.0, min_greedy_agreement=0.95, max_mean_abs_logprob_diff=0.05)


class QualityConfig(BaseModel):
    """Which smoke tests run, how big they are, and the gates (None: chosen from the server kind)."""

    model_config = ConfigDict(extra="forbid")

    humaneval: bool = True
    humaneval_limit: int | None = Field(None, ge=1, description="first N problems (None: all 164)")
    humaneval_max_tokens: int = Field(512, ge=1)
    tool_calls: bool = True
    tool_call_suite: Literal["standard", "agent"] = Field("standard", description="see quality/tool_calls.py")
    tool_call_limit: int | None = Field(None, ge=1)
    tool_call_max_tokens: int = Field(1024, ge=1, description="room to think before calling")
    agreement: bool = True
    agreement_limit: int | None = Field(None, ge=1)
    agreement_max_new_tokens: int = Field(32, ge=1)
    agreement_device: str = "cpu"
    agreement_activations: str | None = Field(None, description="w4a4|w4a16; None: from the profile (w4a4 for URLs)")
    humaneval_thinking: bool = Field(False, description="chat_template_kwargs.thinking for HumanEval requests")
    gates: Gates | None = None

    @classmethod
    def quick(cls, **overrides) -> QualityConfig:
        base = dict(humaneval_limit=4, humaneval_max_tokens=64, tool_call_suite="agent", tool_call_limit=4,
                    tool_call_max_tokens=64, agreement_limit=3, agreement_max_new_tokens=16)
        return cls(**{**base, **overrides})


class TargetInfo(BaseModel):
    model_config = ConfigDict(extra="forbid")

    label: str
    url: str
    profile: str | None = None
    command: list[str] | None = None
    log_path: str | None = None
    ready_s: float | None = None
    reference_emulator: bool = False
    server_info: dict = Field(default_factory=dict)


class QualityReport(BaseModel):
    model_config = ConfigDict(extra="forbid")

    humaneval: HumanEvalReport | None = None
    tool_calls: ToolCallReport | None = None
    agreement: AgreementReport | None = None
    errors: dict[str, str] = Field(default_factory=dict)  # check name -> why it could not run


class GateResult(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    value: float | None
    threshold: float | None  # None for "the check ran" gates
    comparison: str  # ">=", "<=" or "ran"
    passed: bool
    check: str = ""  # key of CHECK_LABELS
    kind: CheckKind = CheckKind.INDEPENDENT
    error: str | None = None  # why the check crashed


class CheckResult(BaseModel):
    """One requested check: its kind, what it compares with, and whether it ran."""

    model_config = ConfigDict(extra="forbid")

    name: str
    kind: CheckKind
    compared_with: str
    ran: bool
    error: str | None = None


class ServeCheckReport(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tool_version: str
    checkpoint: str
    started_at: str
    finished_at: str
    target: TargetInfo
    load: LoadSweep | None = None
    compare_target: TargetInfo | None = None
    compare: LoadSweep | None = None
    replay: ReplayReport | None = None
    compare_replay: ReplayReport | None = None
    quality: QualityReport
    checks: list[CheckResult] = Field(default_factory=list)
    gates: list[GateResult]
    passed: bool

    def failed_gates(self) -> list[GateResult]:
        return [g for g in self.gates if not g.passed]


def _gate(name: str, value: float | None, threshold: float | None, comparison: str, check: str,
          kind: CheckKind) -> GateResult | None:
    if threshold is None:
        return None
    ok = value is not None and (value >= threshold if comparison == ">=" else value <= threshold)
    return GateResult(name=name, value=value, threshold=threshold, comparison=comparison, passed=ok, check=check,
                      kind=kind)


def requested_checks(load: LoadSweep | None, cfg: QualityConfig, replay: ReplayReport | None = None) -> list[str]:
    wanted = {"load": load is not None, "replay": replay is not None, "humaneval": cfg.humaneval,
              "tool_calls": cfg.tool_calls, "agreement": cfg.agreement}
    return [name for name, on in wanted.items() if on]


def _crash(quality: QualityReport, check: str) -> str | None:
    """Why a requested check has no result (None when it has one)."""
    if check in ("load", "replay"):
        return None
    if check in quality.errors:
        return quality.errors[check]
    return None if getattr(quality, check) is not None else "it produced no result"


def summarise_checks(load: LoadSweep | None, quality: QualityReport, cfg: QualityConfig,
                     reference_emulator: bool = False, replay: ReplayReport | None = None) -> list[CheckResult]:
    out = []
    for check in requested_checks(load, cfg, replay):
        kind, compared_with = check_kind(check, reference_emulator)
        error = _crash(quality, check)
        out.append(CheckResult(name=CHECK_LABELS[check], kind=kind, compared_with=compared_with, ran=error is None,
                               error=error))
    return out


def evaluate_gates(gates: Gates, load: LoadSweep | None, quality: QualityReport,
                   cfg: QualityConfig, reference_emulator: bool = False,
                   replay: ReplayReport | None = None) -> list[GateResult]:
    """The gates of every requested check; a check that crashed is one failed gate, gated or not."""
    out: list[GateResult | None] = []
    for check in requested_checks(load, cfg, replay):
        kind, _ = check_kind(check, reference_emulator)
        error = _crash(quality, check)
        if error is not None:
            out.append(GateResult(name=f"{CHECK_LABELS[check]} ran", value=None, threshold=None, comparison="ran",
                                  passed=False, check=check, kind=kind, error=error))
            continue
        if check == "load":
            requests = sum(p.requests for p in load.points)
            errors = sum(p.errors for p in load.points)
            rate = errors / requests if requests else 1.0
            out.append(_gate("load error rate", rate, gates.max_load_error_rate, "<=", check, kind))
        elif check == "replay":  # a request the replay never sent (timed out) is a failed one
            sent = len(replay.requests)
            failed = sum(1 for r in replay.requests if not r.ok)
            out.append(_gate("replay error rate", failed / sent if sent else 1.0, gates.max_load_error_rate, "<=",
                             check, kind))
        elif check == "humaneval":
            out.append(_gate("HumanEval pass@1", quality.humaneval.pass_at_1, gates.min_humaneval_pass_at_1, ">=",
                             check, kind))
        elif check == "tool_calls":
            tc = quality.tool_calls
            out.append(_gate("tool-call trigger rate", tc.trigger_rate, gates.min_tool_trigger_rate, ">=", check, kind))
            out.append(_gate("tool-call schema accuracy", tc.schema_accuracy, gates.min_tool_schema_accuracy, ">=",
                             check, kind))
        else:
            ag = quality.agreement
            out.append(_gate("greedy agreement with emulator", ag.agreement, gates.min_greedy_agreement, ">=",
                             check, kind))
            out.append(_gate("mean |Δlogprob| vs emulator (nats)", ag.mean_abs_logprob_diff,
                             gates.max_mean_abs_logprob_diff, "<=", check, kind))
    return [g for g in out if g is not None]


def _cell(text: str) -> str:
    """Text for a Markdown table cell: a `|` (as in "mean |Δlogprob|") would end the cell."""
    return text.replace("|", "\\|").replace("\n", " ")


def _fmt(x: float | None, spec: str = ".3g") -> str:
    return "–" if x is None else format(x, spec)


def _sweep_table(sweep: LoadSweep) -> list[str]:
    lines = [
        f"Session shape: first context {sweep.first_context_tokens} tokens, +{sweep.tool_result_tokens} per tool "
        f"result, {sweep.output_tokens} output tokens, {sweep.turns} turns; {sweep.num_gpus} GPU(s); "
        f"server context {sweep.context_length}.",
        "",
        "| users | requests | errors | TTFT p50 (s) | TTFT p99 (s) | TPOT p50 (ms) | tok/s/user | "
        "tok/min/GPU | cache hit | mean prompt |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for p in sweep.points:
        hit = "–" if p.cache_hit_rate is None else f"{p.cache_hit_rate:.1%}"
        lines.append(
            f"| {p.concurrency}{' (timed out)' if p.timed_out else ''} | {p.requests} | {p.errors} | "
            f"{_fmt(p.ttft_p50_s)} | {_fmt(p.ttft_p99_s)} | {_fmt(p.tpot_p50_ms)} | {_fmt(p.interactivity_tok_s)} | "
            f"{p.throughput_tok_min_gpu:,.0f} | {hit} | {p.mean_prompt_tokens:,.0f} |"
        )
    samples = [e for p in sweep.points for e in p.error_samples]
    if samples:
        lines += ["", "Errors (samples):", *[f"- `{e}`" for e in samples[:5]]]
    return lines


def _replay_table(r: ReplayReport) -> list[str]:
    p = r.point
    lines = [
        f"Recorded traffic `{r.data}`: {r.recorded_requests} requests over {r.recorded_span_s:,.0f} s, replayed at "
        f"{r.speed:g}x ({r.scheduled_span_s:,.1f} s scheduled) with at most {r.concurrency} in flight"
        + (f"; {r.skipped_too_long} longer than the server's context, not sent" if r.skipped_too_long else "")
        + ("; **timed out**" if r.timed_out else "") + ".",
        "",
        "| sent | errors | latency p50 (s) | latency p99 (s) | recorded p50 (s) | late p99 (s) | TTFT p50 (s) | "
        "tok/min/GPU | cache hit | mean prompt |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        f"| {r.replayed} | {p.errors} | {_fmt(r.latency_p50_s)} | {_fmt(r.latency_p99_s)} | "
        f"{_fmt(r.recorded_latency_p50_s)} | {_fmt(r.lateness_p99_s)} | {_fmt(p.ttft_p50_s)} | "
        f"{p.throughput_tok_min_gpu:,.0f} | {'–' if p.cache_hit_rate is None else f'{p.cache_hit_rate:.1%}'} | "
        f"{p.mean_prompt_tokens:,.0f} |",
    ]
    if p.error_samples:
        lines += ["", "Errors (samples):", *[f"- `{e}`" for e in p.error_samples]]
    return lines


def render_markdown(r: ServeCheckReport, chart_name: str | None) -> str:
    t = r.target
    lines = [
        f"# Serve check: {'PASSED' if r.passed else 'FAILED'}",
        "",
        f"- checkpoint: `{r.checkpoint}`",
        f"- server: {t.label if t.label == t.url else f'{t.label} at {t.url}'}"
        + (" (reference emulator)" if t.reference_emulator else ""),
        f"- tool: kimi-nvfp4 {r.tool_version}; {r.started_at} → {r.finished_at}",
    ]
    if t.command:
        lines.append(f"- command: `{' '.join(t.command)}`")
    lines += ["", "## Gates", "", "| gate | kind | value | threshold | result |", "|---|---|---:|---:|---|"]
    for g in r.gates:
        threshold = "must run" if g.threshold is None else f"{g.comparison} {g.threshold:g}"
        result = "pass" if g.passed else ("**FAIL** (crashed)" if g.error else "**FAIL**")
        lines.append(f"| {_cell(g.name)} | {g.kind.value} | {_fmt(g.value, '.4g')} | {threshold} | {result} |")
    if not r.gates:
        lines.append("| (none) | | | | |")
    if r.checks:
        lines += ["", "## Checks", "",
                  "Independent checks judge the served model against something outside this tool; "
                  "self-consistency checks compare the emulator with itself (they catch serving bugs, not "
                  "conversion errors); operational checks compare nothing.", "",
                  "| check | kind | compared with | ran |", "|---|---|---|---|"]
        for c in r.checks:
            ran = "yes" if c.ran else f"**crashed**: {_cell(c.error or '')}"
            lines.append(f"| {c.name} | {c.kind.value} | {c.compared_with} | {ran} |")
    if r.load is not None:
        lines += ["", f"## Load: {r.load.label}", "", *_sweep_table(r.load)]
    if r.compare is not None:
        lines += ["", f"## Comparison: {r.compare.label}", "", *_sweep_table(r.compare)]
    for title, replayed in (("Replay", r.replay), ("Replay, comparison", r.compare_replay)):
        if replayed is not None:
            lines += ["", f"## {title}: {replayed.label}", "", *_replay_table(replayed)]
    if chart_name:
        lines += ["", f"![throughput per GPU against interactivity]({chart_name})"]
    q = r.quality
    lines += ["", "## Quality smoke tests", ""]
    if q.humaneval:
        lines.append(f"- HumanEval pass@1: {q.humaneval.pass_at_1:.3f} ({q.humaneval.passed}/{q.humaneval.problems}, "
                     f"{q.humaneval.requests_failed} request failures)")
    if q.tool_calls:
        tc = q.tool_calls
        lines.append(f"- Tool calls ({tc.suite} suite): trigger rate {tc.trigger_rate:.2f}, "
                     f"schema accuracy {_fmt(tc.schema_accuracy, '.2f')} "
                     f"over {tc.prompts} prompts")
    if q.agreement:
        ag = q.agreement
        lines.append(f"- Emulator agreement ({ag.activations}): greedy {ag.agreement:.3f} over {ag.tokens} tokens, "
                     f"mean |Δlogprob| {ag.mean_abs_logprob_diff:.4f}, max {ag.max_abs_logprob_diff:.4f}")
    for name, why in q.errors.items():
        lines.append(f"- {CHECK_LABELS.get(name, name)}: **crashed** (a failed gate): {why}")
    return "\n".join(lines) + "\n"


def write_report(report: ServeCheckReport, report_dir: str | Path) -> dict[str, Path]:
    """serve_check.json, serve_check.md and (with any load data) serve_check.png in `report_dir`."""
    from .charts import draw_chart

    out = Path(report_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / f"{REPORT_STEM}.json", "md": out / f"{REPORT_STEM}.md"}
    sweeps = [s for s in (report.load, report.compare) if s is not None]
    if sweeps:
        paths["png"] = out / f"{REPORT_STEM}.png"
        write_bytes_atomic(paths["png"], draw_chart(sweeps))
    write_bytes_atomic(paths["json"], report.model_dump_json(indent=2).encode())
    write_bytes_atomic(paths["md"], render_markdown(report, paths["png"].name if sweeps else None).encode())
    return paths
