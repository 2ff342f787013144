"""The calibration report: what data was used, the activation ranges per layer, expert coverage.

`CalibrationReport` is the JSON artifact (pydantic); `write_calibration_report` also renders the
Markdown summary and the PNG charts next to it.
"""

from __future__ import annotations

import math
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from ..stage_kit.layer_memory import LayerMemory
from ..stage_kit.memory_plan import MemoryPlan
from ..stage_kit.artifacts import markdown_table, new_figure, save_figure, save_model_json, save_text
from .kv_cache import KVCacheCalibration

REPORT_JSON = "calibration_report.json"
REPORT_MD = "calibration_report.md"
COVERAGE_PNG = "expert_coverage.png"
RANGES_PNG = "activation_ranges.png"
# Expert-coverage histogram bins: token counts on a log2 scale (0, 1, 2-3, 4-7, ...).
_COVERAGE_MAX_LOG2 = 24


class LinearRange(BaseModel):
    """Input range of one non-expert linear (BF16, reported for context)."""

    model_config = ConfigDict(extra="forbid", ser_json_inf_nan="constants")

    module: str
    amax: float
    tokens: int


class ExpertCalibration(BaseModel):
    """Per-expert results of one MoE layer, as parallel lists indexed by expert id."""

    model_config = ConfigDict(extra="forbid", ser_json_inf_nan="constants")

    tokens: list[int]  # routed tokens each expert saw
    gate_up_amax: list[float]  # chosen amax (gate_proj and up_proj share it)
    down_amax: list[float]
    gate_up_source: list[str]  # routed | peer-max | route-all | fallback
    down_source: list[str]


class LayerCalibration(BaseModel):
    model_config = ConfigDict(extra="forbid", ser_json_inf_nan="constants")

    layer: int
    is_moe: bool
    linears: list[LinearRange]
    experts: ExpertCalibration | None = None
    experts_below_min_tokens: int = 0
    experts_without_tokens: int = 0
    gate_up_amax_max: float | None = None  # what SGLang's flashinfer backends use for every expert
    down_amax_max: float | None = None


class CalibrationSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", ser_json_inf_nan="constants")

    data: str
    samples: int
    seq_len: int
    seed: int
    min_expert_tokens: int
    policy: str
    heldout_fraction: float
    # compute dtype of the reference model, resolved ("float32" / "bfloat16"); reports and manifests
    # written before it was recorded all computed in float32
    dtype: str = "float32"


class CalibrationReport(BaseModel):
    model_config = ConfigDict(extra="forbid", ser_json_inf_nan="constants")

    checkpoint: str
    source: str
    settings: CalibrationSettings
    device: str
    sequences: int
    tokens: int
    conversations: int
    records_skipped: int
    skip_reasons: list[str]
    input_scales: int  # tensors written
    shard: str
    shard_sha256: str
    seconds: float
    layers: list[LayerCalibration]
    # per layer, in the order run: wall seconds and peak GPU / host memory (stage_kit/layer_memory.py; the host
    # figure is the process's maximum RSS so far); empty / None in reports written before they were recorded
    layer_seconds: list[float] = Field(default_factory=list)
    layer_memory: LayerMemory | None = None
    # FP8 KV-cache scales written (calibrate/kv_cache.py); None when the checkpoint declares no KV quantization
    kv_cache: KVCacheCalibration | None = None
    # where the run kept what, and its estimated peaks (stage_kit/memory_plan.py); rank 0's
    memory_plan: MemoryPlan | None = None

    def coverage_histogram(self) -> tuple[list[str], list[int]]:
        """Expert count per routed-token bucket, over all MoE layers (bucket 0 = never routed)."""
        counts = [0] * (_COVERAGE_MAX_LOG2 + 2)
        for layer in self.layers:
            if layer.experts is None:
                continue
            for t in layer.experts.tokens:
                b = 0 if t == 0 else min(_COVERAGE_MAX_LOG2 + 1, 1 + int(math.log2(t)))
                counts[b] += 1
        last = max((i for i, c in enumerate(counts) if c), default=0)
        labels = ["0"] + [f"{2 ** (b - 1)}-{2**b - 1}" if b > 1 else "1" for b in range(1, last + 1)]
        return labels[: last + 1], counts[: last + 1]


def render_markdown(report: CalibrationReport) -> str:
    s = report.settings
    lines = [
        "# Calibration report",
        "",
        f"- checkpoint: `{report.checkpoint}`",
        f"- source: `{report.source}`",
        f"- data: `{s.data}` — {report.conversations} conversations used for calibration "
        f"({report.records_skipped} records skipped; held-out fraction {s.heldout_fraction} reserved for validate)",
        f"- {report.sequences} sequences × ≤{s.seq_len} tokens = {report.tokens} tokens (seed {s.seed})",
        f"- under-covered experts (< {s.min_expert_tokens} tokens): policy `{s.policy}`",
        f"- {report.input_scales} input_scale tensors written to `{report.shard}` (sha256 {report.shard_sha256[:16]}…)",
        f"- device {report.device}, compute dtype {s.dtype}, {report.seconds:.1f} s",
        "",
        "gate_proj and up_proj of an expert share one input_scale. SGLang's flashinfer MoE backends use the",
        "layer's max over all experts (column *max*), the cutlass backend uses each expert's own value.",
        "",
        "## Per-layer activation ranges (amax of the linear inputs)",
        "",
    ]
    rows = []
    for layer in report.layers:
        dense = max((r.amax for r in layer.linears), default=0.0)
        if layer.experts is not None:
            gu, dn = layer.experts.gate_up_amax, layer.experts.down_amax
            rows.append(
                [
                    layer.layer,
                    "moe",
                    dense,
                    min(gu),
                    layer.gate_up_amax_max or 0.0,
                    min(dn),
                    layer.down_amax_max or 0.0,
                    layer.experts_below_min_tokens,
                    layer.experts_without_tokens,
                ]
            )
        else:
            rows.append([layer.layer, "dense", dense, "", "", "", "", "", ""])
    lines.append(
        markdown_table(
            [
                "layer",
                "kind",
                "BF16 linears max",
                "gate/up min",
                "gate/up max",
                "down min",
                "down max",
                "experts < min tokens",
                "experts with 0 tokens",
            ],
            rows,
        )
    )
    labels, counts = report.coverage_histogram()
    lines += [
        "",
        "## Expert coverage (experts per routed-token bucket, all MoE layers)",
        "",
        markdown_table(["tokens", "experts"], list(zip(labels, counts))),
        "",
        f"![expert coverage]({COVERAGE_PNG})  ![activation ranges]({RANGES_PNG})",
        "",
    ]
    if report.skip_reasons:
        lines += ["## Skipped records (first few)", ""] + [f"- {r}" for r in report.skip_reasons[:10]] + [""]
    return "\n".join(lines)


def _coverage_figure(report: CalibrationReport):
    labels, counts = report.coverage_histogram()
    fig, ax = new_figure(8, 3.5)
    ax.bar(range(len(counts)), counts, color="#4878a8")
    ax.set_xticks(range(len(counts)), labels, rotation=45, ha="right", fontsize=8)
    ax.set_xlabel("routed tokens per expert (all MoE layers)")
    ax.set_ylabel("experts")
    ax.set_title(f"Expert coverage; policy {report.settings.policy}, min {report.settings.min_expert_tokens} tokens")
    m = report.settings.min_expert_tokens
    if m > 0:  # experts left of this line got the policy instead of their own amax
        ax.axvline(1 + int(math.log2(m)) - 0.5, color="#c44", lw=0.8, ls="--", label=f"min {m} tokens")
        ax.legend(fontsize=8)
    return fig


def _ranges_figure(report: CalibrationReport):
    fig, ax = new_figure(8, 3.5)
    moe = [l for l in report.layers if l.experts is not None]
    xs = [l.layer for l in moe]
    if moe:
        ax.fill_between(
            xs,
            [min(l.experts.gate_up_amax) for l in moe],
            [l.gate_up_amax_max for l in moe],
            alpha=0.3,
            label="expert gate/up input (min..max)",
        )
        ax.fill_between(
            xs,
            [min(l.experts.down_amax) for l in moe],
            [l.down_amax_max for l in moe],
            alpha=0.3,
            label="expert down input (min..max)",
        )
    ax.plot(
        [l.layer for l in report.layers],
        [max((r.amax for r in l.linears), default=0) for l in report.layers],
        "k.-",
        lw=0.8,
        label="BF16 linears (max)",
    )
    ax.set_yscale("log")
    ax.set_xlabel("layer")
    ax.set_ylabel("input amax")
    ax.legend(fontsize=8)
    return fig


def write_calibration_report(report: CalibrationReport, directory: Path) -> dict[str, str]:
    directory.mkdir(parents=True, exist_ok=True)
    save_model_json(directory / REPORT_JSON, report)
    save_text(directory / REPORT_MD, render_markdown(report))
    save_figure(directory / COVERAGE_PNG, _coverage_figure(report))
    save_figure(directory / RANGES_PNG, _ranges_figure(report))
    return {
        k: str(directory / v)
        for k, v in (
            ("json", REPORT_JSON),
            ("markdown", REPORT_MD),
            ("coverage_png", COVERAGE_PNG),
            ("ranges_png", RANGES_PNG),
        )
    }
