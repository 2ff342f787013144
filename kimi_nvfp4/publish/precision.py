"""The precision split for the model card, computed from shard headers (no tensor data is read)."""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from ..checkpoint.reader import CheckpointReader

# Categories in display order: (name, regex on the tensor name without its text prefix).
# Order matters: the first match wins (routed experts before the generic mlp patterns).
_CATEGORIES: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("routed experts", re.compile(r"\.mlp\.experts\.\d+\.")),
    ("shared experts", re.compile(r"\.mlp\.shared_experts\.")),
    ("router", re.compile(r"\.mlp\.gate\.(weight|e_score_correction_bias)$")),
    ("dense MLP (layer 0)", re.compile(r"\.mlp\.(gate|up|down)_proj\.")),
    ("MLA attention", re.compile(r"\.self_attn\.")),
    ("norms", re.compile(r"(layernorm|norm)\.weight$")),
    ("embeddings", re.compile(r"embed_tokens\.")),
    ("lm_head", re.compile(r"lm_head\.")),
    ("vision tower", re.compile(r"^vision_tower\.")),
    ("mm_projector", re.compile(r"^mm_projector\.")),
)
OTHER = "other"
# NVFP4 packs two E2M1 values per uint8 byte (docs/formats.md §2: `weight` uint8 [out, in/2]); an unconverted INT4
# source packs eight nibbles per int32 `weight_packed` (docs/formats.md §1).
E2M1_PER_BYTE = 2
INT4_PER_INT32 = 8
_DTYPE_NAMES = {torch.bfloat16: "BF16", torch.float16: "FP16", torch.float32: "FP32", torch.uint8: "NVFP4",
                torch.float8_e4m3fn: "FP8", torch.int32: "INT32", torch.int8: "INT8"}


@dataclass
class PrecisionRow:
    category: str
    formats: set[str]
    tensors: int = 0
    params: int = 0  # weight elements (NVFP4 values counted unpacked); scales not counted
    bytes: int = 0  # everything stored for the category, scales included


def _category(name: str) -> str:
    for category, pattern in _CATEGORIES:
        if pattern.search(name):
            return category
    return OTHER


def _weight_format(reader: CheckpointReader, name: str, dtype: torch.dtype) -> str:
    if name.endswith(".weight_packed"):
        return "INT4 (compressed-tensors)"
    if dtype == torch.uint8 and name.endswith(".weight"):
        base = name[: -len("weight")]
        # W4A4 when calibration wrote a static activation scale, W4A16-capable otherwise.
        return "NVFP4 W4A4" if base + "input_scale" in reader.weight_map else "NVFP4 (weights only)"
    return _DTYPE_NAMES.get(dtype, str(dtype).replace("torch.", ""))


def precision_split(reader: CheckpointReader) -> list[PrecisionRow]:
    rows: dict[str, PrecisionRow] = {}
    prefix = reader.layout.text_prefix
    for name, info in reader.tensors.items():
        short = name[len(prefix):] if prefix and name.startswith(prefix) else name
        row = rows.setdefault(_category(short), PrecisionRow(_category(short), set()))
        row.bytes += info.nbytes
        if name.endswith((".weight", ".weight_packed", "e_score_correction_bias")):
            row.tensors += 1
            numel = 1
            for d in info.shape:
                numel *= d
            if name.endswith(".weight_packed"):
                numel *= INT4_PER_INT32
            elif info.dtype == torch.uint8:
                numel *= E2M1_PER_BYTE
            row.params += numel
            row.formats.add(_weight_format(reader, name, info.dtype))
    order = [c for c, _ in _CATEGORIES] + [OTHER]
    return sorted(rows.values(), key=lambda r: order.index(r.category))


def _human(n: float, units: tuple[str, ...], base: int) -> str:
    """1234567 -> '1.23 M' (first unit printed as an integer)."""
    value = float(n)
    for unit in units:
        if abs(value) < base or unit == units[-1]:
            return f"{value:.0f} {unit}".rstrip() if unit == units[0] else f"{value:.2f} {unit}"
        value /= base
    raise AssertionError("unreachable")


def render_precision_table(rows: list[PrecisionRow]) -> str:
    total_params = sum(r.params for r in rows) or 1
    total_bytes = sum(r.bytes for r in rows)
    lines = ["| part | format | weight tensors | parameters | share | stored |", "|---|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r.category} | {', '.join(sorted(r.formats)) or '-'} | {r.tensors} | "
                     f"{_human(r.params, ('', 'K', 'M', 'B', 'T'), 1000)} | {r.params / total_params:.1%} | "
                     f"{_human(r.bytes, ('B', 'KB', 'MB', 'GB', 'TB'), 1000)} |")
    lines.append(f"| **total** | | {sum(r.tensors for r in rows)} | "
                 f"{_human(total_params, ('', 'K', 'M', 'B', 'T'), 1000)} | 100% | "
                 f"{_human(total_bytes, ('B', 'KB', 'MB', 'GB', 'TB'), 1000)} |")
    return "\n".join(lines) + "\n\nNVFP4 = E2M1 weights, one E4M3 scale per 16 inputs and an FP32 tensor scale " \
                              "(4.5 bits per weight). The FP8 KV cache is declared in `hf_quant_config.json`.\n"
