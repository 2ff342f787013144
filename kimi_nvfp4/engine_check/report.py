"""The engine check's report: what the engine read, built, wrote and computed, and every miss.

One `EngineCheckReport` per run (JSON + Markdown). A *miss* is anything that would make the engine
serve something other than the checkpoint: a tensor the engine read but dropped, a parameter no
tensor wrote (unless the engine itself marks it optional), a module whose quant method disagrees with
what the checkpoint holds, a failed value check, or an engine step that raised. `passed` is "no miss".
"""

from __future__ import annotations

from enum import Enum
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from ..stage_kit.artifacts import markdown_table, save_model_json, save_text

REPORT_JSON = "engine_check_{engine}.json"
REPORT_MD = "engine_check_{engine}.md"
MAX_LISTED = 20  # names shown per list in the Markdown report (the JSON has them all)


class CheckCoverage(str, Enum):
    """What an engine's check measures; the verdict says which, so a rules-only pass never reads like a loader pass."""

    LOADER = "loader"  # the engine's own weight loaders ran over the checkpoint's tensors: not-read / never-written measured
    RULES = "rules"  # config parsing, name mapping and exclusion rules only: tensor-level faults are not measured


COVERAGE_MEANING = {
    CheckCoverage.LOADER: "the engine's own model build and weight loaders ran over every tensor",
    CheckCoverage.RULES: "only the engine's config parsing, name mapping and exclusion rules ran; no weight loader, so "
    "a renamed, missing, transposed or mistyped tensor is NOT detected",
}


class BuildDevice(str, Enum):
    CPU = "cpu"  # parameters hold real values: sentinel audit and value checks
    META = "meta"  # shapes only (full-size models): routing, shapes and quant methods


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", ser_json_inf_nan="constants")


class CpuPatch(_Model):
    """One thing changed so that the engine's code runs on a CPU: what, why, and what it means for the check."""

    target: str
    why: str
    effect: str


class TensorAccounting(_Model):
    in_checkpoint: int  # tensors the index lists
    read: int  # tensors the engine's weight iterator yielded (meta: the index listing, fed as meta tensors)
    routed: int  # read tensors a weight loader received, directly or fused with others by the model's loader
    not_read: list[str] = Field(default_factory=list)  # in the index, never yielded
    read_not_indexed: list[str] = Field(default_factory=list)
    dropped: list[str] = Field(default_factory=list)  # yielded, never reached a weight loader
    fused: dict[str, list[str]] = Field(default_factory=dict)  # parameter -> checkpoint tensors concatenated into it
    routing: str = "a weight loader received it, directly or concatenated by the model's loader"  # what "routed" means


class ParameterVerdict(str, Enum):
    MISS = "miss"  # the engine would serve uninitialised memory or a fill value
    ENGINE_DEFAULT = "engine_default"  # optional in the engine (e.g. k/v scales: 1.0 when absent)
    UNUSED = "unused"  # not written and not consumed under the checkpoint's declared scheme and this backend
    DERIVED = "derived"  # not a checkpoint tensor: the engine computes it from loaded parameters


class ParameterFinding(_Model):
    parameter: str
    dtype: str
    shape: list[int]
    unwritten: int  # elements never written (meta: the whole parameter, no loader call reached it)
    numel: int
    verdict: ParameterVerdict
    reason: str


class ModuleMethods(_Model):
    """The quant method the engine gave each module that has one, against what the checkpoint holds there."""

    by_method: dict[str, int] = Field(default_factory=dict)  # engine quant-method class -> modules
    nvfp4_modules: int = 0  # modules the checkpoint holds NVFP4 tensors for
    mismatches: list[str] = Field(default_factory=list)  # "module: engine Method, checkpoint holds X"


class ValueCheck(_Model):
    name: str
    passed: bool
    checked: int  # items compared (tensors, experts, layers ...)
    detail: str


class EngineCheckReport(_Model):
    engine: str  # a name in engine_registry.ENGINES
    engine_version: str
    checkpoint: str
    device: BuildDevice
    coverage: CheckCoverage = CheckCoverage.LOADER
    architecture: str = ""
    declared_scheme: str = ""  # what the checkpoint's config declares: w4a4 / w4a16
    engine_view: dict[str, str] = Field(default_factory=dict)  # how the engine parsed the quantization config
    settings: dict[str, str] = Field(default_factory=dict)  # backend choices the run used
    tensors: TensorAccounting | None = None
    modules: ModuleMethods = Field(default_factory=ModuleMethods)
    parameters_total: int = 0
    parameters_written: int = 0
    parameter_findings: list[ParameterFinding] = Field(default_factory=list)
    values: list[ValueCheck] = Field(default_factory=list)
    errors: list[str] = Field(default_factory=list)  # engine steps that raised (a miss each)
    patches: list[CpuPatch] = Field(default_factory=list)
    ran: list[str] = Field(default_factory=list)  # the engine's own code that ran, in order
    not_run: list[str] = Field(default_factory=list)  # what could not run on a CPU, and why
    seconds: float = 0.0

    @property
    def misses(self) -> list[str]:
        out = [f"error: {e}" for e in self.errors]
        if self.tensors is not None:
            out += [f"tensor never read by the engine: {n}" for n in self.tensors.not_read]
            out += [f"tensor read but dropped by the engine's loader: {n}" for n in self.tensors.dropped]
        out += [f"quant method: {m}" for m in self.modules.mismatches]
        out += [
            f"parameter never written: {p.parameter} ({p.unwritten}/{p.numel} elements): {p.reason}"
            for p in self.parameter_findings
            if p.verdict is ParameterVerdict.MISS
        ]
        out += [f"value check {v.name}: {v.detail}" for v in self.values if not v.passed]
        return out

    @property
    def passed(self) -> bool:
        return not self.misses

    @property
    def verdict(self) -> str:
        """One line: PASS/FAIL and, for a rules-only check, that it is one (never the same words as a loader pass)."""
        if not self.passed:
            return f"FAIL: {len(self.misses)} misses"
        if self.coverage is CheckCoverage.RULES:
            return "PASS (rules only): no miss in the config, name-mapping and exclusion rules; no weight loader ran"
        return "PASS: no miss"

    def save(self, folder: str | Path) -> tuple[Path, Path]:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        name = self.engine
        json_path = save_model_json(folder / REPORT_JSON.format(engine=name), self)
        md_path = save_text(folder / REPORT_MD.format(engine=name), self.to_markdown())
        return json_path, md_path

    def to_markdown(self) -> str:
        lines = [
            f"# Engine check: {self.engine} {self.engine_version} on {self.device.value}",
            "",
            f"Checkpoint `{self.checkpoint}` ({self.architecture}), declares {self.declared_scheme or '?'}. "
            f"**{self.verdict}** ({self.seconds:.1f} s).",
            "",
            f"Coverage: {self.coverage.value}: {COVERAGE_MEANING[self.coverage]}.",
            "",
        ]
        if self.engine_view or self.settings:
            rows = [(k, v) for k, v in {**self.engine_view, **self.settings}.items()]
            lines += ["## How the engine reads it", "", markdown_table(["item", "value"], rows), ""]
        if self.misses:
            lines += ["## Misses", ""] + [f"- {m}" for m in self.misses[:MAX_LISTED]]
            if len(self.misses) > MAX_LISTED:
                lines.append(f"- ... {len(self.misses) - MAX_LISTED} more in the JSON report")
            lines.append("")
        if self.tensors is not None:
            t = self.tensors
            lines += [
                "## Tensors",
                "",
                markdown_table(
                    ["in checkpoint", "read", "routed", "not read", "dropped", "fused parameters"],
                    [(t.in_checkpoint, t.read, t.routed, len(t.not_read), len(t.dropped), len(t.fused))],
                ),
                "",
                f"Routed: {t.routing}.",
                "",
            ]
        rows = sorted(self.modules.by_method.items())
        lines += [
            "## Quant methods",
            "",
            f"{self.modules.nvfp4_modules} modules hold NVFP4 tensors in the checkpoint; "
            f"{len(self.modules.mismatches)} disagree with the engine.",
            "",
            markdown_table(["engine method", "modules"], rows) if rows else "(none)",
            "",
        ]
        if self.parameters_total:
            lines += [
                "## Parameters",
                "",
                f"{self.parameters_written} of {self.parameters_total} parameters fully written by the checkpoint.",
                "",
            ]
        if self.parameter_findings:
            shown = self.parameter_findings[:MAX_LISTED]
            lines += [
                markdown_table(
                    ["parameter", "unwritten", "verdict", "why"],
                    [(p.parameter, f"{p.unwritten}/{p.numel}", p.verdict.value, p.reason) for p in shown],
                ),
                "",
            ]
        if self.values:
            lines += [
                "## Values checked",
                "",
                markdown_table(
                    ["check", "passed", "checked", "detail"],
                    [(v.name, "yes" if v.passed else "NO", v.checked, v.detail) for v in self.values],
                ),
                "",
            ]
        if self.patches:
            lines += [
                "## What was patched to run on a CPU",
                "",
                markdown_table(["target", "why", "effect"], [(p.target, p.why, p.effect) for p in self.patches]),
                "",
            ]
        if self.ran:
            lines += ["## Engine code that ran", ""] + [f"- {r}" for r in self.ran] + [""]
        if self.not_run:
            lines += ["## Not run", ""] + [f"- {r}" for r in self.not_run] + [""]
        return "\n".join(lines)
