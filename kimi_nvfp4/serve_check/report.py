"""The serve-check report: pydantic models, gates, and the Markdown rendering.

Gates have two default sets. `Gates.production()` is for real SGLang runs of Kimi K2.6 (thresholds
explained in docs/serve_check.md); `Gates.reference()` is for the reference emulator, where the
model is usually the tiny demo one: only the checks a tiny model can pass are gated (the server
and the emulator must agree; no request may fail).
"""

from __future__ import annotations

import os
from pathlib import Path

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from .loadgen import LoadSweep
from .quality.agreement import AgreementReport
from .quality.humaneval import HumanEvalReport
from .quality.tool_calls import ToolCallReport

REPORT_STEM = "serve_check"


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
    threshold: float
    comparison: str  # ">=" or "<="
    passed: bool


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
    quality: QualityReport
    gates: list[GateResult]
    passed: bool

    def failed_gates(self) -> list[GateResult]:
        return [g for g in self.gates if not g.passed]


def _gate(name: str, value: float | None, threshold: float | None, comparison: str) -> GateResult | None:
    if threshold is None:
        return None
    ok = value is not None and (value >= threshold if comparison == ">=" else value <= threshold)
    return GateResult(name=name, value=value, threshold=threshold, comparison=comparison, passed=ok)


def evaluate_gates(gates: Gates, load: LoadSweep | None, quality: QualityReport,
                   cfg: QualityConfig) -> list[GateResult]:
    """A check that was asked for but could not run fails its gate (value None)."""
    out: list[GateResult | None] = []
    if load is not None:
        requests = sum(p.requests for p in load.points)
        errors = sum(p.errors for p in load.points)
        rate = errors / requests if requests else 1.0
        out.append(_gate("load error rate", rate, gates.max_load_error_rate, "<="))
    if cfg.humaneval:
        he = quality.humaneval
        out.append(_gate("HumanEval pass@1", he.pass_at_1 if he else None, gates.min_humaneval_pass_at_1, ">="))
    if cfg.tool_calls:
        tc = quality.tool_calls
        out.append(_gate("tool-call trigger rate", tc.trigger_rate if tc else None, gates.min_tool_trigger_rate, ">="))
        out.append(_gate("tool-call schema accuracy", tc.schema_accuracy if tc else None,
                         gates.min_tool_schema_accuracy, ">="))
    if cfg.agreement:
        ag = quality.agreement
        out.append(_gate("greedy agreement with emulator", ag.agreement if ag else None,
                         gates.min_greedy_agreement, ">="))
        out.append(_gate("mean |Δlogprob| vs emulator (nats)", ag.mean_abs_logprob_diff if ag else None,
                         gates.max_mean_abs_logprob_diff, "<="))
    return [g for g in out if g is not None]


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
    lines += ["", "## Gates", "", "| gate | value | threshold | result |", "|---|---:|---:|---|"]
    for g in r.gates:
        lines.append(f"| {g.name} | {_fmt(g.value, '.4g')} | {g.comparison} {g.threshold:g} | "
                     f"{'pass' if g.passed else '**FAIL**'} |")
    if not r.gates:
        lines.append("| (none) | | | |")
    if r.load is not None:
        lines += ["", f"## Load: {r.load.label}", "", *_sweep_table(r.load)]
    if r.compare is not None:
        lines += ["", f"## Comparison: {r.compare.label}", "", *_sweep_table(r.compare)]
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
        lines.append(f"- {name}: could not run: {why}")
    return "\n".join(lines) + "\n"


def atomic_write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.partial")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_report(report: ServeCheckReport, report_dir: str | Path) -> dict[str, Path]:
    """serve_check.json, serve_check.md and (with any load data) serve_check.png in `report_dir`."""
    from .charts import draw_chart

    out = Path(report_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / f"{REPORT_STEM}.json", "md": out / f"{REPORT_STEM}.md"}
    sweeps = [s for s in (report.load, report.compare) if s is not None]
    if sweeps:
        paths["png"] = out / f"{REPORT_STEM}.png"
        atomic_write_bytes(paths["png"], draw_chart(sweeps))
    atomic_write_bytes(paths["json"], report.model_dump_json(indent=2).encode())
    atomic_write_bytes(paths["md"], render_markdown(report, paths["png"].name if sweeps else None).encode())
    return paths
