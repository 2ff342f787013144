"""Is this source checkpoint one we can convert? Checked from config.json and shard headers only.

Accepted: compressed-tensors `pack-quantized`, one config group, symmetric INT4 weights with
`strategy group`, `group_size 32`, no activation quantization, no `actorder` — exactly what Kimi
K2.5 / K2.6 / K2-Thinking ship (docs/formats.md §1). When both the top level and `text_config` carry a
quantization_config they must agree. Everything else is refused with the field that differs.
"""

from __future__ import annotations

from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, ValidationError

from ..errors import UnsupportedCheckpointError
from ..numerics.constants import INT4_BITS, INT4_GROUP_SIZE, INT4_PER_INT32
from .layout import PROJS, CheckpointLayout
from .reader import CONFIG_NAME

CT_QUANT_METHOD = "compressed-tensors"
CT_FORMAT = "pack-quantized"
INT4_EXPERT_SUFFIXES = ("weight_packed", "weight_scale", "weight_shape")
# Suffixes that mark a compressed tensor; outside routed experts they mean a layout we do not handle.
COMPRESSED_SUFFIXES = (".weight_packed", ".weight_scale", ".weight_shape", ".weight_zero_point", ".weight_g_idx")


class _Loose(BaseModel):
    model_config = ConfigDict(extra="allow")


class Int4WeightArgs(_Loose):
    num_bits: int
    type: str
    symmetric: bool
    strategy: str
    group_size: int | None = None
    actorder: Any = None
    dynamic: bool | str = False


class CTGroup(_Loose):
    targets: list[str]
    weights: Int4WeightArgs | None = None
    input_activations: dict[str, Any] | None = None
    output_activations: dict[str, Any] | None = None


class CTQuantConfig(_Loose):
    quant_method: str
    format: str | None = None
    config_groups: dict[str, CTGroup]
    ignore: list[str] = []


def _refuse(msg: str) -> UnsupportedCheckpointError:
    return UnsupportedCheckpointError(f"quantization_config: {msg}", file=CONFIG_NAME)


def check_quantization_config(config: dict[str, Any]) -> CTQuantConfig:
    """Validate the compressed-tensors block(s); return the parsed block."""
    blocks = {"top level": config.get("quantization_config")}
    if isinstance(config.get("text_config"), dict) and "quantization_config" in config["text_config"]:
        blocks["text_config"] = config["text_config"]["quantization_config"]
    present = {k: v for k, v in blocks.items() if v is not None}
    if not present:
        raise _refuse("missing; expected Kimi's compressed-tensors INT4 block (is this an unquantized or already converted checkpoint?)")
    if len(present) == 2 and present["top level"] != present["text_config"]:
        raise _refuse("the top-level and text_config blocks differ; refusing to guess which one applies")
    raw = next(iter(present.values()))
    method = raw.get("quant_method") if isinstance(raw, dict) else None
    if method != CT_QUANT_METHOD:
        raise _refuse(f"quant_method {method!r} is not supported; expected {CT_QUANT_METHOD!r}")
    try:
        parsed = CTQuantConfig.model_validate(raw)
    except ValidationError as e:
        raise _refuse(f"malformed ({str(e).splitlines()[0]})") from None
    if parsed.format != CT_FORMAT:
        raise _refuse(f"format {parsed.format!r} is not supported; expected {CT_FORMAT!r}")
    if len(parsed.config_groups) != 1:
        raise _refuse(f"{len(parsed.config_groups)} config_groups; expected exactly one (INT4 routed experts)")
    (name, group), = parsed.config_groups.items()
    w = group.weights
    if w is None:
        raise _refuse(f"{name} has no weights scheme")
    expected = {
        "num_bits": INT4_BITS, "type": "int", "symmetric": True, "strategy": "group", "group_size": INT4_GROUP_SIZE,
    }
    for key, want in expected.items():
        got = getattr(w, key)
        if got != want:
            raise _refuse(f"{name}.weights.{key} is {got!r}; only {key}={want!r} is supported (Kimi K2 INT4)")
    if w.actorder not in (None, False):
        raise _refuse(f"{name}.weights.actorder is {w.actorder!r}; activation-ordered groups are not supported")
    if w.dynamic not in (False, None):
        raise _refuse(f"{name}.weights.dynamic is {w.dynamic!r}; expected static weights")
    if group.input_activations is not None or group.output_activations is not None:
        raise _refuse(f"{name} quantizes activations; only weight-only INT4 is supported")
    return parsed


def expert_matrix_shape(layout: CheckpointLayout, proj: str) -> tuple[int, int]:
    """[out, in] of a routed-expert matrix from the config."""
    c = layout.text
    if proj not in PROJS:
        raise ValueError(proj)
    return (c.hidden_size, c.moe_intermediate_size) if proj == "down_proj" else (c.moe_intermediate_size, c.hidden_size)


def expected_int4_tensors(out_f: int, in_f: int) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """suffix -> (dtype, shape) of one compressed-tensors pack-quantized INT4 matrix."""
    return {
        "weight_packed": (torch.int32, (out_f, in_f // INT4_PER_INT32)),
        "weight_scale": (torch.bfloat16, (out_f, in_f // INT4_GROUP_SIZE)),
        "weight_shape": (torch.int32, (2,)),
    }
