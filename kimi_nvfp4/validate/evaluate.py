"""Validate's verdict: every gate over what the streams measured (structure, weights, per-layer drift and
per-expert error, end-to-end KL / top-1 / perplexity, and the checkpoint against the amax baseline)."""

from __future__ import annotations

import math
from typing import Sequence

from ..model.linear import ActivationMode
from .baseline import BASELINE_MODE
from .gates import GateResult, GateThresholds, gate_check, gate_max, gate_min
from .report import EndToEnd, LayerValidation
from .structure import StructureReport
from .weights import WeightSummary


def evaluate_gates(
    thresholds: GateThresholds,
    structure: StructureReport,
    weights: WeightSummary | None,
    layers: list[LayerValidation],
    end_to_end: list[EndToEnd],
    mode_errors: dict[str, str],
    modes: Sequence[ActivationMode],
    baseline: EndToEnd | None = None,
) -> list[GateResult]:
    gates = [
        gate_check(
            f"structure.{c.name}",
            c.issues + ([f"... {c.issue_count - len(c.issues)} more"] if c.issue_count > len(c.issues) else []),
        )
        for c in structure.checks
    ]
    if weights is not None:
        if weights.flagged_count:
            more = weights.flagged_count - len(weights.flagged)
            worst = f"{weights.flagged_count} matrices above: " + ", ".join(weights.flagged[:10])
            worst += f" ... {more} more" if more > 0 else ""
        else:
            worst = f"worst: {weights.worst[0].module}" if weights.worst else ""
        gates += [
            gate_check("weights.readable", weights.unreadable),
            gate_max("weights.rel_mse_max", weights.rel_mse_max, thresholds.weight_rel_mse_max, worst),
            gate_max("weights.rel_mse_mean", weights.rel_mse_mean, thresholds.weight_rel_mse_mean_max),
            gate_min("weights.exact_fraction", weights.exact_fraction, thresholds.weight_exact_fraction_min),
        ]
    e2e = {e.mode: e for e in end_to_end}
    for mode in modes:
        m, t = mode.value, thresholds.for_mode(mode)
        if m in mode_errors:
            gates.append(gate_check(f"{m}.ran", [mode_errors[m]]))
            continue
        drifts = [(l.drift[m], l.layer) for l in layers if m in l.drift]
        if drifts:
            d, at = max(drifts)
            gates.append(gate_max(f"{m}.drift_max", d, t.drift_max, f"layer {at}"))
        experts = [(l.expert_rel_mse_max[m], l.layer, l.worst_expert[m]) for l in layers if m in l.expert_rel_mse_max]
        if experts:
            v, layer, e = max(experts)
            gates.append(
                gate_max(f"{m}.expert_output_rel_mse_max", v, t.expert_output_rel_mse_max, f"layer {layer} expert {e}")
            )
        if m in e2e:
            r = e2e[m]
            gates += [
                gate_max(f"{m}.kl_mean", r.kl_mean, t.kl_mean_max),
                gate_max(f"{m}.kl_p99", r.kl_p99, t.kl_p99_max),
                gate_min(f"{m}.top1", r.top1, t.top1_min),
                gate_max(
                    f"{m}.ppl_ratio",
                    r.ppl_ratio,
                    t.ppl_ratio_max,
                    f"ppl INT4 {r.ppl_int4:.4g}, NVFP4 {r.ppl_nvfp4:.4g}",
                ),
            ]
    gates += _baseline_gates(thresholds, layers, e2e, baseline)
    return gates


def _baseline_gates(
    thresholds: GateThresholds, layers: list[LayerValidation], e2e: dict[str, EndToEnd], baseline: EndToEnd | None
) -> list[GateResult]:
    """The checkpoint's W4A16 figures over the amax baseline's (validate/baseline.py)."""
    mine = e2e.get(BASELINE_MODE.value)
    if baseline is None or mine is None:
        return []
    kl_ratio = mine.kl_mean / baseline.kl_mean if baseline.kl_mean > 0 else (1.0 if mine.kl_mean == 0 else math.inf)
    gates = [gate_max("baseline.kl_mean_ratio", kl_ratio, thresholds.baseline_kl_ratio_max,
                      f"KL mean {mine.kl_mean:.4g} vs amax baseline {baseline.kl_mean:.4g} (W4A16)")]
    ratios = [
        (l.drift[BASELINE_MODE.value] / l.baseline_drift, l.layer)
        for l in layers
        if l.baseline_drift and BASELINE_MODE.value in l.drift
    ]
    if ratios:
        worst, at = max(ratios)
        gates.append(gate_max("baseline.drift_ratio_max", worst, thresholds.baseline_drift_ratio_max,
                              f"layer {at}: drift over the amax baseline's (W4A16)"))
    return gates
