"""Structural checks of a converted checkpoint under SGLang's loading rules (docs/formats.md §3).

Pure checkpoint reads, no model: config blocks at both levels, `hf_quant_config.json`, the exclude
list against the BF16 linears, every NVFP4 linear's tensors (names, dtypes, shapes), scale rules
(gate/up share `weight_scale_2`; `input_scale` present, finite, > 0, equal for gate/up), block
scales, and no NaN/Inf in any floating tensor. Works for both layouts (K2.6 prefix, K2-Thinking).

Every check collects all its issues instead of stopping at the first, so the report can say
what is wrong everywhere at once.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Iterable

import torch
from pydantic import BaseModel, ConfigDict

from ..stage_kit.pairing import (
    COMPRESSED_TENSORS_QUANT_METHOD,
    HF_QUANT_CONFIG_NAME,
    MODELOPT_QUANT_METHOD,
    NVFP4_QUANT_ALGO,
)
from ..checkpoint.layout import PROJS, parse_expert_name
from ..checkpoint.modelopt_config import QUANT_ALGO_W4A16_NVFP4, bf16_linear_modules, is_excluded
from ..checkpoint.reader import CheckpointReader
from ..numerics.constants import NVFP4_BLOCK_SIZE

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.float8_e4m3fn, torch.float8_e5m2)
# Elements checked per slice when scanning big tensors for NaN/Inf (bounded extra memory).
_SCAN_CHUNK_ELEMENTS = 64 * 1024 * 1024
MAX_ISSUES_PER_CHECK = 50


class StructureCheck(BaseModel):
    model_config = ConfigDict(extra="forbid", ser_json_inf_nan="constants")

    name: str
    passed: bool
    issues: list[str]  # the first MAX_ISSUES_PER_CHECK
    issue_count: int


class StructureReport(BaseModel):
    model_config = ConfigDict(extra="forbid", ser_json_inf_nan="constants")

    checks: list[StructureCheck]
    nvfp4_linears: int
    bf16_linears: int
    tensors_scanned: int

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)

    def failed(self) -> list[StructureCheck]:
        return [c for c in self.checks if not c.passed]


@dataclass
class _Issues:
    found: dict[str, list[str]] = field(default_factory=dict)

    def add(self, check: str, message: str) -> None:
        self.found.setdefault(check, []).append(message)

    def ensure(self, check: str) -> None:
        self.found.setdefault(check, [])


def expected_nvfp4_shapes(reader: CheckpointReader) -> dict[str, tuple[int, int]]:
    """Module name -> (out, in) for every routed expert linear the config promises, plus the shared experts
    where the checkpoint holds them as NVFP4."""
    t = reader.layout.text
    dims = {
        "gate_proj": (t.moe_intermediate_size, t.hidden_size),
        "up_proj": (t.moe_intermediate_size, t.hidden_size),
        "down_proj": (t.hidden_size, t.moe_intermediate_size),
    }
    expected = {
        reader.layout.expert_module(layer, e, proj): dims[proj]
        for layer in t.moe_layers
        for e in range(t.n_routed_experts)
        for proj in PROJS
    }
    # Shared experts converted with `convert --shared-experts nvfp4` (their weight_scale_2 says so).
    width = t.moe_intermediate_size * t.n_shared_experts
    shared_dims = {"gate_proj": (width, t.hidden_size), "up_proj": (width, t.hidden_size), "down_proj": (t.hidden_size, width)}
    for layer in t.moe_layers if t.n_shared_experts else ():
        for proj in PROJS:
            module = f"{reader.layout.layer_prefix(layer)}mlp.shared_experts.{proj}"
            if f"{module}.weight_scale_2" in reader:
                expected[module] = shared_dims[proj]
    return expected


def _nonfinite_count(t: torch.Tensor) -> int:
    flat = t.reshape(-1)
    bad = 0
    for start in range(0, flat.numel(), _SCAN_CHUNK_ELEMENTS):
        piece = flat[start : start + _SCAN_CHUNK_ELEMENTS]
        if piece.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            piece = piece.to(torch.float32)
        bad += int((~torch.isfinite(piece)).sum())
    return bad


def _check_configs(reader: CheckpointReader, issues: _Issues) -> dict:
    for c in ("config.quantization_config", "config.no_stale_compressed_tensors", "hf_quant_config"):
        issues.ensure(c)
    cfg = reader.config
    top = cfg.get("quantization_config") or {}
    if top.get("quant_method") != MODELOPT_QUANT_METHOD or top.get("quant_algo") != NVFP4_QUANT_ALGO:
        issues.add(
            "config.quantization_config",
            f"config.json quantization_config has quant_method={top.get('quant_method')!r} "
            f"quant_algo={top.get('quant_algo')!r}, expected {MODELOPT_QUANT_METHOD!r}/{NVFP4_QUANT_ALGO!r} "
            f"(W4A4; {QUANT_ALGO_W4A16_NVFP4!r} means calibrate has not run)",
        )
    levels = [("config.json", cfg)]
    if reader.layout.text_config_dict is not cfg:
        levels.append(("config.json text_config", reader.layout.text_config_dict))
    for where, block in levels:
        for key in ("quantization_config", "compression_config"):
            qc = block.get(key)
            if isinstance(qc, dict) and (
                qc.get("quant_method") == COMPRESSED_TENSORS_QUANT_METHOD
                or (qc.get("quant_method") != MODELOPT_QUANT_METHOD and qc.get("format") is not None)
            ):
                issues.add(
                    "config.no_stale_compressed_tensors",
                    f"{where} still has a compressed-tensors {key} (format {qc.get('format')!r}); "
                    "engines would misdetect the format",
                )
    path = reader.root / HF_QUANT_CONFIG_NAME
    hf: dict = {}
    if not path.is_file():
        issues.add("hf_quant_config", f"{HF_QUANT_CONFIG_NAME} is missing")
        return hf
    try:
        hf = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        issues.add("hf_quant_config", f"{HF_QUANT_CONFIG_NAME} is not valid JSON ({e})")
        return {}
    if not isinstance(hf, dict) or not isinstance(hf.get("quantization"), dict):
        issues.add("hf_quant_config", f"{HF_QUANT_CONFIG_NAME} is not an object with a quantization object")
        return {}
    q = hf["quantization"]
    if q.get("quant_algo") != NVFP4_QUANT_ALGO:
        issues.add("hf_quant_config", f"quantization.quant_algo is {q.get('quant_algo')!r}, expected 'NVFP4'")
    if q.get("group_size") != NVFP4_BLOCK_SIZE:
        issues.add(
            "hf_quant_config", f"quantization.group_size is {q.get('group_size')!r}, expected {NVFP4_BLOCK_SIZE}"
        )
    if not isinstance(q.get("exclude_modules"), list):
        issues.add("hf_quant_config", "quantization.exclude_modules is missing (SGLang requires it)")
    return hf


def _check_exclude_list(reader: CheckpointReader, hf: dict, nvfp4: Iterable[str], issues: _Issues) -> int:
    issues.ensure("exclude_list")
    patterns = list((hf.get("quantization") or {}).get("exclude_modules") or [])
    ignore = (reader.config.get("quantization_config") or {}).get("ignore")
    if ignore is not None and sorted(ignore) != sorted(patterns):
        issues.add(
            "exclude_list", "config.json quantization_config.ignore differs from hf_quant_config exclude_modules"
        )
    bf16 = bf16_linear_modules(reader)
    for module in bf16:
        if not is_excluded(module, patterns):
            issues.add(
                "exclude_list", f"BF16 linear {module} is not in exclude_modules (SGLang would expect NVFP4 tensors)"
            )
    for module in sorted(nvfp4):
        if is_excluded(module, patterns):
            issues.add("exclude_list", f"NVFP4 linear {module} matches an exclude_modules pattern")
    return len(bf16)


def _expect(info, dtype: torch.dtype, shape: tuple[int, ...]) -> str | None:
    if info.dtype != dtype or tuple(info.shape) != shape:
        return f"is {info.dtype} {list(info.shape)}, expected {dtype} {list(shape)}"
    return None


def check_structure(
    output: CheckpointReader,
    source: CheckpointReader | None = None,
    *,
    progress: bool = True,
) -> StructureReport:
    """Run every structural check; never raises for a problem in the checkpoint (they become issues)."""
    from tqdm.auto import tqdm

    issues = _Issues()
    hf = _check_configs(output, issues)
    expected = expected_nvfp4_shapes(output)
    for c in (
        "nvfp4_tensors",
        "gate_up_weight_scale_2_equal",
        "input_scale",
        "gate_up_input_scale_equal",
        "block_scales",
        "finite",
        "source_tensors",
    ):
        issues.ensure(c)

    # Names and shapes, from headers only.
    for module, (out_f, in_f) in expected.items():
        wants = {
            "weight": (torch.uint8, (out_f, in_f // 2)),
            "weight_scale": (torch.float8_e4m3fn, (out_f, in_f // NVFP4_BLOCK_SIZE)),
            "weight_scale_2": (torch.float32, ()),
        }
        for suffix, (dtype, shape) in wants.items():
            name = f"{module}.{suffix}"
            if name not in output:
                issues.add("nvfp4_tensors", f"{name} is missing")
            elif (why := _expect(output.info(name), dtype, shape)) is not None:
                issues.add("nvfp4_tensors", f"{name} {why}")
        name = f"{module}.input_scale"
        if name not in output:
            issues.add("input_scale", f"{name} is missing (run `kimi-nvfp4 calibrate`)")
        elif (why := _expect(output.info(name), torch.float32, ())) is not None:
            issues.add("input_scale", f"{name} {why}")
    for name in output.weight_map:
        p = parse_expert_name(name)
        if p is not None and p.suffix in ("weight_packed", "weight_shape"):
            issues.add("nvfp4_tensors", f"{name}: INT4 tensor left in the converted checkpoint")
        if (p is None and output.info(name).dtype == torch.uint8 and name.endswith(".weight")
                and name.removesuffix(".weight") not in expected):
            issues.add("nvfp4_tensors", f"{name}: NVFP4 weight outside the routed (and NVFP4 shared) experts")

    bf16_count = _check_exclude_list(output, hf, expected, issues)

    # Values: one pass over every tensor, shard by shard.
    scalars: dict[str, float] = {}
    names = sorted(output.weight_map, key=lambda n: (output.weight_map[n], n))
    scanned = 0
    for name in tqdm(names, desc="structure: scanning tensors", unit="tensor", disable=not progress):
        info = output.info(name)
        if info.dtype not in FLOAT_DTYPES:
            continue
        t = output.load(name)
        scanned += 1
        bad = _nonfinite_count(t)
        if bad:
            issues.add("finite", f"{name} has {bad} NaN/Inf values")
        if name.endswith((".weight_scale_2", ".input_scale")) and t.ndim == 0:
            scalars[name] = float(t)
        elif name.endswith(".weight_scale") and info.dtype == torch.float8_e4m3fn:
            _check_block_scales(output, name, t, issues)

    for module in expected:
        for suffix, check in (("weight_scale_2", "nvfp4_tensors"), ("input_scale", "input_scale")):
            v = scalars.get(f"{module}.{suffix}")
            if v is not None and not (v > 0 and v < float("inf")):
                issues.add(check, f"{module}.{suffix} = {v} (must be finite and > 0)")
    _check_gate_up_equal(output, expected, scalars, "weight_scale_2", "gate_up_weight_scale_2_equal", issues)
    _check_gate_up_equal(output, expected, scalars, "input_scale", "gate_up_input_scale_equal", issues)

    if source is not None:
        for name in sorted(source.weight_map):
            if parse_expert_name(name) is not None or name.removesuffix(".weight") in expected:
                continue  # converted: routed experts, and shared experts quantized from BF16
            if name not in output:
                issues.add("source_tensors", f"{name} is in the source but not in the output")
                continue
            a, b = source.info(name), output.info(name)
            if a.dtype != b.dtype or a.shape != b.shape:
                issues.add(
                    "source_tensors", f"{name} is {b.dtype} {list(b.shape)}, the source has {a.dtype} {list(a.shape)}"
                )

    checks = [
        StructureCheck(name=k, passed=not v, issues=v[:MAX_ISSUES_PER_CHECK], issue_count=len(v))
        for k, v in issues.found.items()
    ]
    return StructureReport(checks=checks, nvfp4_linears=len(expected), bf16_linears=bf16_count, tensors_scanned=scanned)


def _check_block_scales(output: CheckpointReader, name: str, scales: torch.Tensor, issues: _Issues) -> None:
    """ModelOpt never writes a zero block scale (clamped to >= 2^-9); a zero scale over non-zero codes loses weights."""
    zero = scales.to(torch.float32) == 0
    if not bool(zero.any()):
        return
    weight_name = name[: -len("_scale")]
    if weight_name not in output:
        return
    codes = output.load(weight_name)  # uint8 [out, in/2]: one block of 16 values = 8 bytes
    blocks_nonzero = (codes.reshape(codes.shape[0], -1, NVFP4_BLOCK_SIZE // 2) & 0x77).any(dim=-1)
    lost = int((zero & blocks_nonzero).sum()) if blocks_nonzero.shape == zero.shape else int(zero.sum())
    if lost:
        issues.add("block_scales", f"{name} has {lost} zero block scales over non-zero codes (weights lost)")


def _check_gate_up_equal(
    output: CheckpointReader,
    expected: dict[str, tuple[int, int]],
    scalars: dict[str, float],
    suffix: str,
    check: str,
    issues: _Issues,
) -> None:
    """SGLang keeps gate's weight_scale_2 for the fused w13 GEMM and reduces input scales by max
    (modelopt_quant.py ModelOptNvFp4FusedMoEMethod.process_weights_after_loading), so gate and up
    must carry identical values or up_proj is silently mis-scaled."""
    for module in expected:
        if not module.endswith(".gate_proj"):
            continue
        up = module[: -len("gate_proj")] + "up_proj"
        g, u = scalars.get(f"{module}.{suffix}"), scalars.get(f"{up}.{suffix}")
        if g is not None and u is not None and g != u:
            issues.add(check, f"{module}.{suffix} = {g!r} but {up}.{suffix} = {u!r}")
