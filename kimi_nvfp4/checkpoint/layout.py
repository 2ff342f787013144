"""Which checkpoint layout we are looking at, and the tensor names it uses (docs/formats.md §1).

Two layouts are supported, told apart by config.json alone (never by file names):
- Kimi K2.5 / K2.6: `KimiK25ForConditionalGeneration`, text model under `text_config`, tensor
  names prefixed `language_model.`, plus `vision_tower.*` / `mm_projector.*` passed through.
- Kimi-K2-Thinking / K2-Instruct: plain `DeepseekV3ForCausalLM`, no prefix.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum
from typing import Any

from ..errors import UnsupportedCheckpointError
from .k2_config import K2Config

PROJS = ("gate_proj", "up_proj", "down_proj")

_EXPERT_RE = re.compile(
    r"^(?P<prefix>.*?)model\.layers\.(?P<layer>\d+)\.mlp\.experts\.(?P<expert>\d+)\."
    r"(?P<proj>gate_proj|up_proj|down_proj)\.(?P<suffix>[a-z_0-9]+)$"
)
_LAYER_RE = re.compile(r"^(?P<prefix>.*?)model\.layers\.(?P<layer>\d+)\.(?P<rest>.+)$")


class LayoutKind(str, Enum):
    KIMI_K25 = "kimi_k25"
    DEEPSEEK_V3 = "deepseek_v3"


@dataclass(frozen=True)
class ExpertTensorName:
    """A parsed routed-expert tensor name: `{prefix}model.layers.L.mlp.experts.E.{proj}.{suffix}`."""

    prefix: str
    layer: int
    expert: int
    proj: str  # gate_proj | up_proj | down_proj
    suffix: str  # weight_packed | weight_scale | weight_shape | weight | weight_scale_2 | input_scale

    @property
    def module(self) -> str:
        return f"{self.prefix}model.layers.{self.layer}.mlp.experts.{self.expert}.{self.proj}"


def parse_expert_name(name: str) -> ExpertTensorName | None:
    m = _EXPERT_RE.match(name)
    if m is None:
        return None
    return ExpertTensorName(
        prefix=m["prefix"], layer=int(m["layer"]), expert=int(m["expert"]), proj=m["proj"], suffix=m["suffix"]
    )


def layer_of(name: str) -> int | None:
    """Decoder layer index a tensor belongs to, or None for embeddings / norm / head / vision."""
    m = _LAYER_RE.match(name)
    return int(m["layer"]) if m else None


@dataclass(frozen=True)
class CheckpointLayout:
    kind: LayoutKind
    text_prefix: str  # "language_model." for K2.5/K2.6, "" for plain DeepseekV3
    text: K2Config
    config: dict[str, Any]  # the whole config.json as read

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "CheckpointLayout":
        archs = config.get("architectures") or []
        if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
            raise UnsupportedCheckpointError(f"architectures is {archs!r}; expected a list of class names",
                                             file="config.json")
        if "KimiK25ForConditionalGeneration" in archs or config.get("model_type") == "kimi_k25":
            text = config.get("text_config")
            if not isinstance(text, dict):
                raise UnsupportedCheckpointError("kimi_k25 config.json has no text_config", file="config.json")
            return cls(LayoutKind.KIMI_K25, "language_model.", K2Config.from_dict(text), config)
        if "DeepseekV3ForCausalLM" in archs or config.get("model_type") in ("deepseek_v3", "kimi_k2"):
            return cls(LayoutKind.DEEPSEEK_V3, "", K2Config.from_dict(config), config)
        raise UnsupportedCheckpointError(
            f"architectures {archs} / model_type {config.get('model_type')!r}: expected "
            "KimiK25ForConditionalGeneration or DeepseekV3ForCausalLM",
            file="config.json",
        )

    @property
    def text_config_dict(self) -> dict[str, Any]:
        return self.config["text_config"] if self.kind is LayoutKind.KIMI_K25 else self.config

    # --- tensor names -------------------------------------------------------------------
    @property
    def embed_name(self) -> str:
        return f"{self.text_prefix}model.embed_tokens.weight"

    @property
    def final_norm_name(self) -> str:
        return f"{self.text_prefix}model.norm.weight"

    @property
    def lm_head_name(self) -> str:
        return f"{self.text_prefix}lm_head.weight"

    def layer_prefix(self, layer: int) -> str:
        return f"{self.text_prefix}model.layers.{layer}."

    def expert_module(self, layer: int, expert: int, proj: str) -> str:
        return f"{self.layer_prefix(layer)}mlp.experts.{expert}.{proj}"

    def module_path(self, tensor_name: str) -> str:
        """Module name as engines see it (`model.layers.3.self_attn.q_a_proj`), prefix kept."""
        return tensor_name.rsplit(".", 1)[0]
