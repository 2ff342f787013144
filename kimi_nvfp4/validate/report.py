"""The validation report: JSON for machines, Markdown and PNG plots for people.

It says which gate failed and by how much; everything the gates look at is in it.
"""

from __future__ import annotations

import math
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from ..stage_kit.layer_memory import LayerMemory
from ..stage_kit.memory_plan import MemoryPlan
from ..stage_kit.artifacts import markdown_table, new_figure, save_figure, save_model_json, save_text
from ..checkpoint.verdict import ValidateVerdict
from .experts import ExpertError
from .gates import GateResult, GateThresholds
from .structure import StructureReport
from .weights import WeightSummary

REPORT_JSON = "validate_report.json"
REPORT_MD = "validate_report.md"
DRIFT_PNG = "layer_drift.png"
KL_PNG = "kl_histogram.png"
WORST_PNG = "worst_experts.png"


class EndToEnd(BaseModel):
    """NVFP4 against INT4 on the held-out tokens, for one emulation mode."""

    model_config = ConfigDict(extra="forbid", ser_json_inf_nan="constants")

    mode: str
    positions: int
    kl_mean: float
    kl_p99: float
    kl_max: float
    top1: float
    ppl_int4: float
    ppl_nvfp4: float
    ppl_ratio: float
    kl_histogram_edges: list[float]
    kl_histogram_counts: list[int]


class LayerValidation(BaseModel):
    model_config = ConfigDict(extra="forbid", ser_json_inf_nan="constants")

    layer: int
    drift: dict[str, float]  # mode -> relative MSE between the INT4 and NVFP4 hidden states after this layer
    expert_rel_mse_max: dict[str, float] = {}
    worst_expert: dict[str, int] = {}
    # drift of the Model Optimizer-rule (amax) conversion of the same experts, W4A16 (validate/baseline.py)
    baseline_drift: float | None = None


class ValidationSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", ser_json_inf_nan="constants")

    data: str
    samples: int
    seq_len: int
    seed: int
    modes: list[str]
    input_scale_reduction: str
    # compute dtype of every stream: bf16 on CUDA by default (as SGLang serves), fp32 on CPU
    dtype: str = "float32"
    # tokens compared per expert and layer by the per-expert check (0: all; None: a report from before the cap)
    expert_check_tokens: int | None = None


class ValidationReport(BaseModel):
    model_config = ConfigDict(extra="forbid", ser_json_inf_nan="constants")

    checkpoint: str
    source: str
    settings: ValidationSettings
    thresholds: GateThresholds
    device: str
    sequences: int
    tokens: int
    conversations: int
    seconds: float
    structure: StructureReport
    weights: WeightSummary | None
    layers: list[LayerValidation]
    # per layer, in the order run: wall seconds and peak GPU / host memory (stage_kit/layer_memory.py; the host
    # figure is the process's maximum RSS so far); empty / None in reports written before they were recorded
    layer_seconds: list[float] = Field(default_factory=list)
    layer_memory: LayerMemory | None = None
    worst_experts: list[ExpertError]
    end_to_end: list[EndToEnd]
    baseline: EndToEnd | None = None  # the amax baseline stream end to end (validate/baseline.py)
    mode_errors: dict[str, str]  # a mode that could not run, and why
    # where the run kept what, and its estimated peaks (stage_kit/memory_plan.py); None in reports written before
    memory_plan: MemoryPlan | None = None
    gates: list[GateResult]
    passed: bool
    # The verdict sealed to the shard digests, thresholds and data judged (checkpoint/verdict.py); publish reads it
    # from the manifest only.
    verdict: ValidateVerdict | None = None

    def failed_gates(self) -> list[GateResult]:
        return [g for g in self.gates if not g.passed]


def _gate_row(g: GateResult) -> list:
    value = "" if g.value is None else g.value
    threshold = "" if g.threshold is None else g.threshold
    margin = "" if g.margin is None or g.passed else f"{g.margin:+.4g}"
    return ["PASS" if g.passed else "**FAIL**", g.name, value, g.comparison, threshold, margin, g.detail[:200]]


def _failure_line(g: GateResult) -> str:
    """`- **w4a4.kl_mean**: 0.41 vs <= 0.3 (off by 0.11) detail`"""
    text = f"- **{g.name}**:"
    if g.value is not None:
        text += f" {g.value:.4g} vs {g.comparison} {g.threshold:.4g}"
    if g.margin is not None:
        text += f" (off by {g.margin:.4g})"
    return f"{text} {g.detail}".rstrip()


def render_markdown(r: ValidationReport) -> str:
    verdict = "PASSED" if r.passed else f"FAILED ({len(r.failed_gates())} of {len(r.gates)} gates)"
    s = r.settings
    lines = [
        f"# Validation report: {verdict}",
        "",
        f"- checkpoint `{r.checkpoint}` against INT4 source `{r.source}`",
        f"- held-out data `{s.data}`: {r.conversations} conversations, {r.sequences} sequences, {r.tokens} tokens "
        f"(seq-len {s.seq_len}, seed {s.seed})",
        f"- modes {', '.join(s.modes)}; expert input scales reduced `{s.input_scale_reduction}` "
        "(as SGLang serves them)",
        f"- device {r.device}, {r.seconds:.1f} s",
        "",
    ]
    if not r.passed:
        lines += ["## Failed gates", ""] + [_failure_line(g) for g in r.failed_gates()] + [""]
    lines += [
        "## Gates",
        "",
        markdown_table(["", "gate", "value", "", "threshold", "margin", "detail"], [_gate_row(g) for g in r.gates]),
        "",
    ]
    for mode, err in r.mode_errors.items():
        lines.append(f"- mode `{mode}` could not run: {err}")
    if r.end_to_end:
        lines += [
            "",
            "## End to end (held-out tokens)",
            "",
            markdown_table(
                ["mode", "positions", "KL mean", "KL p99", "KL max", "top-1", "ppl INT4", "ppl NVFP4", "ratio"],
                [
                    [e.mode, e.positions, e.kl_mean, e.kl_p99, e.kl_max, e.top1, e.ppl_int4, e.ppl_nvfp4, e.ppl_ratio]
                    for e in r.end_to_end
                ],
            ),
            "",
            f"![KL histogram]({KL_PNG})",
            "",
        ]
    if r.weights is not None:
        w = r.weights
        lines += [
            "## Weights (NVFP4 values against INT4 values)",
            "",
            f"{w.matrices} matrices: pooled relative MSE {w.rel_mse:.4g}, mean {w.rel_mse_mean:.4g}, "
            f"worst {w.rel_mse_max:.4g}; {100 * w.exact_fraction:.2f}% of values exact.",
            "",
            markdown_table(
                ["worst matrices", "rel MSE", "exact", "max abs err"],
                [[m.module, m.rel_mse, m.exact_fraction, m.max_abs_error] for m in w.worst],
            ),
            "",
        ]
    lines += ["## Per layer", "", f"![drift]({DRIFT_PNG})  ![worst experts]({WORST_PNG})", ""]
    modes = s.modes
    lines.append(
        markdown_table(
            ["layer"] + [f"drift {m}" for m in modes] + [f"worst expert {m}" for m in modes],
            [
                [l.layer]
                + [l.drift.get(m, "") for m in modes]
                + [f"{l.worst_expert[m]}: {l.expert_rel_mse_max[m]:.4g}" if m in l.worst_expert else "" for m in modes]
                for l in r.layers
            ],
        )
    )
    lines += [
        "",
        "## Structure (SGLang loading rules)",
        "",
        markdown_table(
            ["check", "result", "issues"],
            [
                [c.name, "ok" if c.passed else f"{c.issue_count} issues", "; ".join(c.issues[:3])]
                for c in r.structure.checks
            ],
        ),
        "",
    ]
    return "\n".join(lines)


def _drift_figure(r: ValidationReport):
    fig, ax = new_figure(8, 3.5)
    for mode in r.settings.modes:
        pts = [(l.layer, l.drift[mode]) for l in r.layers if mode in l.drift and l.drift[mode] > 0]
        if pts:
            ax.plot(*zip(*pts), ".-", label=f"{mode} drift")
    for mode, style in zip(r.settings.modes, ("--", ":")):
        ax.axhline(r.thresholds.for_mode(mode).drift_max, color="#c44", lw=0.8, ls=style, label=f"{mode} gate")
    ax.set_xticks([l.layer for l in r.layers])
    ax.set_yscale("log")
    ax.set_xlabel("layer")
    ax.set_ylabel("relative MSE of hidden states")
    ax.set_title("NVFP4 vs INT4 hidden-state drift")
    ax.legend(fontsize=8)
    return fig


def _kl_figure(r: ValidationReport):
    fig, ax = new_figure(8, 3.5)
    for e in r.end_to_end:
        edges, counts = e.kl_histogram_edges, e.kl_histogram_counts
        if not all(math.isfinite(x) for x in edges):  # NaN weights give NaN logits and KL: nothing to draw
            ax.plot([], [], " ", label=f"{e.mode}: KL is not finite (NaN/Inf), no histogram")
            continue
        ax.stairs(counts, edges, label=f"{e.mode}: mean {e.kl_mean:.3g}, p99 {e.kl_p99:.3g}")
    ax.set_xscale("log")
    ax.set_xlabel("per-token KL(INT4 || NVFP4), nats (first bin includes everything below)")
    ax.set_ylabel("tokens")
    ax.legend(fontsize=8)
    return fig


def _worst_figure(r: ValidationReport):
    fig, ax = new_figure(8, 3.5)
    items = r.worst_experts[:15]
    if items:
        ax.barh(range(len(items)), [x.rel_mse for x in items], color="#4878a8")
        ax.set_yticks(
            range(len(items)), [f"L{x.layer} E{x.expert} {x.mode} ({x.tokens} tok)" for x in items], fontsize=7
        )
        ax.invert_yaxis()
    ax.set_xlabel("expert output relative MSE on its routed tokens")
    ax.set_title("Worst experts")
    return fig


def write_validation_report(r: ValidationReport, directory: Path) -> dict[str, str]:
    directory.mkdir(parents=True, exist_ok=True)
    save_model_json(directory / REPORT_JSON, r)
    save_text(directory / REPORT_MD, render_markdown(r))
    save_figure(directory / DRIFT_PNG, _drift_figure(r))
    save_figure(directory / KL_PNG, _kl_figure(r))
    save_figure(directory / WORST_PNG, _worst_figure(r))
    return {
        k: str(directory / v)
        for k, v in (
            ("json", REPORT_JSON),
            ("markdown", REPORT_MD),
            ("drift_png", DRIFT_PNG),
            ("kl_png", KL_PNG),
            ("worst_experts_png", WORST_PNG),
        )
    }
