"""Find the validate / serve-check reports of a converted folder and render them as card sections.

The report schemas belong to those stages; this module renders any JSON report generically (top-level
scalars as a metrics table, lists of records as tables) and picks out a `gates` / `checks` list when there is one,
so the card keeps working as the reports grow fields.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..checkpoint.manifest import load_manifest
from ..errors import CheckpointError

VALIDATE_REPORT = "validate_report.json"
SERVE_CHECK_REPORT = "serve_check.json"
SERVE_CHECK_CHART = "serve_check.png"
DEFAULT_REPORT_DIR = "reports"
_MAX_TABLE_ROWS = 40


@dataclass
class ReportSet:
    validate: Path | None
    serve_check: Path | None
    serve_check_chart: Path | None

    @classmethod
    def find(cls, folder: Path, report_dir: str | Path | None = None) -> ReportSet:
        """Look in `report_dir`, the paths the stage records list, `folder/reports`, then `folder`."""
        dirs: list[Path] = [Path(report_dir)] if report_dir else []
        try:
            stages = load_manifest(folder).stages
        except CheckpointError:
            stages = {}
        for stage in ("validate", "serve_check"):
            record = stages.get(stage)
            for value in (record.outputs.values() if record is not None else ()):
                if not isinstance(value, str):
                    continue
                path = Path(value) if Path(value).is_absolute() else folder / value
                if value.endswith((".json", ".png", ".md")):
                    dirs.append(path.parent)
                elif path.is_dir():  # validate records its report folder
                    dirs.append(path)
        dirs += [folder / DEFAULT_REPORT_DIR, folder]

        def first(name: str) -> Path | None:
            return next((d / name for d in dirs if (d / name).is_file()), None)

        return cls(first(VALIDATE_REPORT), first(SERVE_CHECK_REPORT), first(SERVE_CHECK_CHART))


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, bool):
        return "pass" if value else "**FAIL**"
    if isinstance(value, (dict, list)):
        text = json.dumps(value, sort_keys=True)
        return f"`{text[:60]}…`" if len(text) > 60 else f"`{text}`"
    return str(value).replace("|", "\\|")


def records_table(records: list[dict[str, Any]]) -> str:
    """A Markdown table over the union of the records' keys (first-seen order)."""
    keys: list[str] = []
    for record in records:
        keys += [k for k in record if k not in keys]
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for record in records[:_MAX_TABLE_ROWS]:
        lines.append("| " + " | ".join(_cell(record.get(k, "")) for k in keys) + " |")
    if len(records) > _MAX_TABLE_ROWS:
        lines.append(f"\n({len(records) - _MAX_TABLE_ROWS} more rows in the JSON report)")
    return "\n".join(lines) + "\n"


def _as_records(value: Any) -> list[dict[str, Any]] | None:
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        return value
    if isinstance(value, dict) and value and all(isinstance(v, dict) for v in value.values()):
        return [{"name": k, **v} for k, v in value.items()]
    return None


def render_report(data: dict[str, Any]) -> str:
    """Scalars first (one metrics table), then each list/mapping of records as its own table."""
    scalars = {k: v for k, v in data.items() if isinstance(v, (str, int, float, bool)) or v is None}
    out = []
    if scalars:
        out.append("| metric | value |\n|---|---|\n" + "\n".join(f"| {k} | {_cell(v)} |" for k, v in scalars.items()))
    for key, value in data.items():
        records = _as_records(value)
        if records is not None:
            out.append(f"**{key}**\n\n" + records_table(records))
    return "\n\n".join(out) + "\n"


def _fmt(value: Any, digits: int = 4) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}g}"
    return str(value)


def gates_table(gates: list[dict[str, Any]]) -> str:
    """Measured gates as rows; check-only gates (no value) summarised in one line."""
    measured = [g for g in gates if g.get("value") is not None]
    checks = [g for g in gates if g.get("value") is None]
    lines = []
    if measured:
        lines += ["| gate | value | threshold | result |", "|---|---:|---:|---|"]
        lines += [f"| {_cell(str(g.get('name')))} | {_fmt(g.get('value'))} | {g.get('comparison', '')} "
                  f"{_fmt(g.get('threshold'))} | {'pass' if g.get('passed') else '**FAIL**'} |" for g in measured]
    if checks:
        failed = [g.get("name") for g in checks if not g.get("passed")]
        lines.append(f"\nStructure checks: {len(checks) - len(failed)}/{len(checks)} passed"
                     + (f" (failed: {', '.join(failed)})" if failed else "") + ".")
    return "\n".join(lines) + "\n"


def render_validation(data: dict[str, Any]) -> str | None:
    """validate_report.json (validate/report.py ValidationReport); None if it is not that shape."""
    gates, e2e = data.get("gates"), data.get("end_to_end")
    if not isinstance(gates, list) or not isinstance(e2e, list):
        return None
    settings = data.get("settings") or {}
    out = [f"{'All gates passed' if data.get('passed') else '**Validation FAILED**'} — NVFP4 against the INT4 "
           f"source on {data.get('sequences', '?')} held-out sequences ({data.get('tokens', '?')} tokens, "
           f"data `{settings.get('data', '?')}`).\n"]
    if e2e:
        out += ["| activations | positions | KL mean | KL p99 | top-1 agreement | ppl INT4 | ppl NVFP4 | ppl ratio |",
                "|---|---:|---:|---:|---:|---:|---:|---:|"]
        out += [f"| {r.get('mode')} | {r.get('positions', '-')} | {_fmt(r.get('kl_mean'))} | {_fmt(r.get('kl_p99'))} | "
                f"{_fmt(r.get('top1'))} | {_fmt(r.get('ppl_int4'))} | {_fmt(r.get('ppl_nvfp4'))} | "
                f"{_fmt(r.get('ppl_ratio'))} |" for r in e2e]
        out.append("")
    weights = data.get("weights")
    if isinstance(weights, dict):
        exact = weights.get("exact_fraction")
        exact_pct = _fmt(100 * exact, 3) if isinstance(exact, float) else "-"
        out.append(f"Weights: {weights.get('matrices', '?')} expert matrices, relative MSE mean "
                   f"{_fmt(weights.get('rel_mse_mean'))} (max {_fmt(weights.get('rel_mse_max'))}), "
                   f"{exact_pct}% of INT4 values reproduced exactly.\n")
    out.append("**Gates**\n\n" + gates_table(gates))
    return "\n".join(out)


def render_serve_check(data: dict[str, Any]) -> str | None:
    """serve_check.json (serve_check/report.py ServeCheckReport); None if it is not that shape."""
    gates, target = data.get("gates"), data.get("target")
    if not isinstance(gates, list) or not isinstance(target, dict):
        return None
    info = target.get("server_info") or {}
    server = ("the reference emulator (CPU, SGLang's HTTP API)" if target.get("reference_emulator")
              else f"SGLang profile `{target.get('profile')}`" if target.get("profile") else "a running server")
    out = [f"{'All gates passed' if data.get('passed') else '**Serving check FAILED**'} — served by {server}"
           + (f", quantization `{info['quantization']}`" if info.get("quantization") else "") + ".\n"]
    load = data.get("load")
    if isinstance(load, dict) and isinstance(load.get("points"), list) and load["points"]:
        out.append(f"Closed-loop coding-agent load: {load.get('turns', '?')} turns per session, "
                   f"{load.get('output_tokens', '?')} output tokens per turn.\n")
        out += ["| concurrency | requests | errors | TTFT p50 (s) | TPOT p50 (ms) | tok/s per user | "
                "tokens/min/GPU | cache hit |", "|---:|---:|---:|---:|---:|---:|---:|---:|"]
        out += [f"| {p.get('concurrency')} | {p.get('requests')} | {p.get('errors')} | "
                f"{_fmt(p.get('ttft_p50_s'), 3)} | {_fmt(p.get('tpot_p50_ms'), 3)} | "
                f"{_fmt(p.get('interactivity_tok_s'), 3)} | "
                f"{_fmt(p.get('throughput_tok_min_gpu'), 3)} | {_fmt(p.get('cache_hit_rate'), 3)} |"
                for p in load["points"]]
        out.append("")
    quality = data.get("quality")
    if isinstance(quality, dict):
        rows = []
        he, tc, ag = quality.get("humaneval"), quality.get("tool_calls"), quality.get("agreement")
        if isinstance(he, dict):
            rows.append(f"| HumanEval pass@1 | {_fmt(he.get('pass_at_1'), 3)} ({he.get('problems', '?')} problems) |")
        if isinstance(tc, dict):
            rows.append(f"| tool calls: trigger rate / schema accuracy | {_fmt(tc.get('trigger_rate'), 3)} / "
                        f"{_fmt(tc.get('schema_accuracy'), 3)} ({tc.get('prompts', '?')} prompts) |")
        if isinstance(ag, dict):
            rows.append(f"| greedy agreement with the emulator | {_fmt(ag.get('agreement'), 3)} "
                        f"(mean abs logprob diff {_fmt(ag.get('mean_abs_logprob_diff'), 3)}) |")
        if rows:
            out += ["| quality check | result |", "|---|---|", *rows, ""]
    out.append("**Gates**\n\n" + gates_table(gates))
    return "\n".join(out)


_RENDERERS = {VALIDATE_REPORT: render_validation, SERVE_CHECK_REPORT: render_serve_check}


def render_report_section(title: str, path: Path | None, folder: Path, *, missing: str,
                          chart: Path | None = None) -> str:
    if path is None:
        return f"## {title}\n\n{missing}\n"
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"report is not valid JSON ({e})", file=path) from None
    body = None
    if isinstance(data, dict):
        specific = _RENDERERS.get(path.name)
        body = specific(data) if specific is not None else None
        body = body or render_report(data)
    else:
        body = f"```json\n{json.dumps(data, indent=1)}\n```\n"
    inside = path.resolve().is_relative_to(folder.resolve())
    where = path.resolve().relative_to(folder.resolve()).as_posix() if inside else path.name
    section = f"## {title}\n\n{body}\nFull report: `{where}`" + ("" if inside else " (not uploaded)") + ".\n"
    if chart is not None:
        if chart.resolve().is_relative_to(folder.resolve()):
            section += f"\n![{title}]({chart.resolve().relative_to(folder.resolve()).as_posix()})\n"
        else:
            section += f"\n(Chart `{chart}` lies outside the uploaded folder and is not published.)\n"
    return section
