"""Validation gates: thresholds (defaults, config file, command-line overrides) and their verdicts.

Defaults were measured on the bundled demo model (docs/validate.md says how); a user tightens or
loosens them with a TOML/JSON file (`--gates FILE`) and/or `--gate KEY=VALUE` (dotted keys, e.g.
`w4a4.kl_mean_max=0.02`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import tomllib
from pydantic import BaseModel, ConfigDict, ValidationError

from ..errors import KimiNvfp4Error
from ..model.linear import ActivationMode


class ModeThresholds(BaseModel):
    """End-to-end gates for one emulation mode (NVFP4 against the INT4 source)."""

    model_config = ConfigDict(extra="forbid", ser_json_inf_nan="constants")

    kl_mean_max: float  # mean per-token KL(INT4 || NVFP4), nats
    kl_p99_max: float  # 99th percentile of the per-token KL, nats
    top1_min: float  # fraction of positions where both models' argmax agree
    ppl_ratio_max: float  # perplexity(NVFP4) / perplexity(INT4) on the held-out tokens
    drift_max: float  # worst per-layer relative MSE between the two hidden-state streams
    expert_output_rel_mse_max: float  # worst expert: relative MSE of its output on its routed tokens


class GateThresholds(BaseModel):
    model_config = ConfigDict(extra="forbid", ser_json_inf_nan="constants")

    weight_rel_mse_max: float  # worst single matrix: relative MSE of NVFP4 values against INT4 values
    weight_rel_mse_mean_max: float  # mean over all matrices
    weight_exact_fraction_min: float  # mean fraction of INT4 values reproduced exactly
    w4a4: ModeThresholds
    w4a16: ModeThresholds
    # The checkpoint against Model Optimizer's rule on the same experts (validate/baseline.py), W4A16: at most
    # this many times the baseline's KL mean, and at most this many times its hidden-state drift at any layer.
    # 1.10: held-out draws move KL by up to ~6% (issue 16's measurement); a correct int4-aware conversion
    # measured 0.60x (KL) on the demo, a broken one is worse than round-to-nearest by far more.
    baseline_kl_ratio_max: float = 1.10
    baseline_drift_ratio_max: float = 1.10

    def for_mode(self, mode: ActivationMode | str) -> ModeThresholds:
        return getattr(self, ActivationMode(mode).value)


# Measured on the bundled demo model (docs/validate.md, "How the default thresholds were chosen"):
# a correct conversion (convert default method, calibrate defaults on `builtin` sessions) measured
# on 32 x 256 held-out tokens, then loosened: error-like values x2 (x4 for the single worst weight
# matrix), top-1 minus 0.05, perplexity ratio 1.05 / 1.03. Every corruption in
# kimi_nvfp4/validate/corruptions.py fails by a wide margin (a corrupted matrix has rel MSE >= 0.3).
DEFAULT_GATES = GateThresholds(
    weight_rel_mse_max=0.02,  # measured 0.0052
    weight_rel_mse_mean_max=0.01,  # measured 0.0051
    weight_exact_fraction_min=0.07,  # measured 0.142
    w4a4=ModeThresholds(
        kl_mean_max=0.3,  # measured 0.136
        kl_p99_max=3.0,  # measured 1.46
        top1_min=0.8,  # measured 0.863
        ppl_ratio_max=1.05,  # measured 1.015
        drift_max=0.1,  # measured 0.041 (last layer)
        expert_output_rel_mse_max=0.1,  # measured 0.047
    ),
    w4a16=ModeThresholds(
        kl_mean_max=0.15,  # measured 0.064
        kl_p99_max=1.7,  # measured 0.84
        top1_min=0.85,  # measured 0.910
        ppl_ratio_max=1.03,  # measured 0.991
        drift_max=0.05,  # measured 0.019
        expert_output_rel_mse_max=0.05,  # measured 0.017
    ),
)


class GateConfigError(KimiNvfp4Error):
    """A gates file or --gate override is malformed."""


def _set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node = data
    for p in parts[:-1]:
        if not isinstance(node.get(p), dict):
            raise GateConfigError(f"--gate {key}: {p!r} is not a group of thresholds")
        node = node[p]
    if parts[-1] not in node or isinstance(node[parts[-1]], dict):
        raise GateConfigError(f"--gate {key}: no such threshold (see `kimi-nvfp4 validate --help`)")
    node[parts[-1]] = value


def parse_override(text: str) -> tuple[str, float]:
    key, sep, value = text.partition("=")
    if not sep:
        raise GateConfigError(f"--gate {text!r}: expected KEY=VALUE, e.g. w4a4.kl_mean_max=0.02")
    try:
        number = float(value)
    except ValueError:
        raise GateConfigError(f"--gate {text!r}: {value!r} is not a number") from None
    if not math.isfinite(number):
        raise GateConfigError(f"--gate {text!r}: the threshold must be finite")
    return key.strip(), number


def load_gates(
    path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = (), base: GateThresholds = DEFAULT_GATES
) -> GateThresholds:
    """Defaults, then a TOML/JSON file (a partial set of keys is fine), then KEY=VALUE overrides."""
    data = base.model_dump()
    if path is not None:
        path = Path(path)
        try:
            text = path.read_text()
            loaded = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
        except FileNotFoundError:
            raise GateConfigError(f"file {path}: gates file does not exist") from None
        except (tomllib.TOMLDecodeError, json.JSONDecodeError) as e:
            raise GateConfigError(f"file {path}: cannot parse gates ({e})") from None
        _merge(data, loaded, str(path))
    for text in overrides:
        key, value = parse_override(text)
        _set_dotted(data, key, value)
    try:
        return GateThresholds.model_validate(data)
    except ValidationError as e:
        raise GateConfigError(f"invalid gates: {e.errors()[0]['loc']}: {e.errors()[0]['msg']}") from None


def _merge(into: dict[str, Any], new: dict[str, Any], where: str, prefix: str = "") -> None:
    for k, v in new.items():
        if k not in into:
            raise GateConfigError(f"file {where}: unknown threshold {prefix + k!r}")
        if isinstance(into[k], dict):
            if not isinstance(v, dict):
                raise GateConfigError(f"file {where}: {prefix + k!r} must be a table of thresholds")
            _merge(into[k], v, where, prefix + k + ".")
        else:
            into[k] = v


class GateResult(BaseModel):
    """One gate's verdict: the measured value, the threshold, and by how much it failed."""

    model_config = ConfigDict(extra="forbid", ser_json_inf_nan="constants")

    name: str
    passed: bool
    value: float | None  # None for pass/fail checks (structure)
    threshold: float | None
    comparison: str  # "<=", ">=", "no issues"
    detail: str = ""

    @property
    def margin(self) -> float | None:
        """How far past the threshold (positive = failed by this much)."""
        if self.value is None or self.threshold is None:
            return None
        return self.value - self.threshold if self.comparison == "<=" else self.threshold - self.value


def gate_max(name: str, value: float, threshold: float, detail: str = "") -> GateResult:
    passed = math.isfinite(value) and value <= threshold
    return GateResult(name=name, passed=passed, value=value, threshold=threshold, comparison="<=", detail=detail)


def gate_min(name: str, value: float, threshold: float, detail: str = "") -> GateResult:
    passed = math.isfinite(value) and value >= threshold
    return GateResult(name=name, passed=passed, value=value, threshold=threshold, comparison=">=", detail=detail)


def gate_check(name: str, issues: list[str]) -> GateResult:
    detail = "; ".join(issues[:5]) + (f"; ... {len(issues) - 5} more" if len(issues) > 5 else "")
    return GateResult(name=name, passed=not issues, value=None, threshold=None, comparison="no issues", detail=detail)
