"""What the converted checkpoint holds, from its config and shard headers: the side the engine is checked against.

Kept engine-agnostic: the tensor listing (name -> dtype, shape, file), which modules are NVFP4
(those with a `weight_scale_2`), the activation scheme and KV-cache algorithm the config declares.
A view can also be built from a listing without shard files (`CheckpointView.from_listing`), for
the meta-device check of a full-size model whose 595 GB of shards do not exist.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..checkpoint.modelopt_config import (
    HF_QUANT_CONFIG_NAME,
    INPUT_SCALE_SUFFIX,
    TENSOR_SCALE_SUFFIX,
    ActivationScheme,
)
from ..checkpoint.reader import CONFIG_NAME, CheckpointReader, TensorInfo
from ..errors import CheckpointError


@dataclass(frozen=True)
class CheckpointView:
    root: Path
    config: dict[str, Any]
    hf_quant_config: dict[str, Any]
    tensors: dict[str, TensorInfo]  # every tensor the index lists
    has_shard_files: bool  # False for a listing-only view (meta check of a full-size config)

    @classmethod
    def from_folder(cls, root: str | Path) -> "CheckpointView":
        """Read `root`'s config.json, hf_quant_config.json and shard headers (no tensor data)."""
        reader = CheckpointReader(root)
        return cls(reader.root, reader.config, _read_hf_quant_config(reader.root), dict(reader.tensors), True)

    @classmethod
    def from_listing(cls, root: str | Path, tensors: dict[str, TensorInfo]) -> "CheckpointView":
        """`root` holds config.json and hf_quant_config.json only; `tensors` says what the shards would hold."""
        root = Path(root)
        try:
            config = json.loads((root / CONFIG_NAME).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise CheckpointError(f"cannot read ({e})", file=root / CONFIG_NAME) from None
        return cls(root, config, _read_hf_quant_config(root), dict(tensors), False)

    @property
    def architecture(self) -> str:
        return (self.config.get("architectures") or ["?"])[0]

    @property
    def quantization(self) -> dict[str, Any]:
        return self.hf_quant_config.get("quantization") or {}

    @property
    def declared_scheme(self) -> ActivationScheme:
        try:
            return ActivationScheme.from_quant_algo(self.quantization.get("quant_algo"))
        except ValueError as e:
            raise CheckpointError(str(e), file=self.root / HF_QUANT_CONFIG_NAME) from None

    @property
    def kv_cache_quant_algo(self) -> str | None:
        return self.quantization.get("kv_cache_quant_algo")

    @property
    def nvfp4_modules(self) -> list[str]:
        """Checkpoint module names that hold NVFP4 tensors (a `weight_scale_2` marks each)."""
        return sorted(n[: -len(TENSOR_SCALE_SUFFIX)] for n in self.tensors if n.endswith(TENSOR_SCALE_SUFFIX))

    @property
    def input_scales(self) -> list[str]:
        return sorted(n for n in self.tensors if n.endswith(INPUT_SCALE_SUFFIX))


def _read_hf_quant_config(root: Path) -> dict[str, Any]:
    path = root / HF_QUANT_CONFIG_NAME
    if not path.is_file():
        raise CheckpointError(
            f"{HF_QUANT_CONFIG_NAME} is missing: not a converted NVFP4 checkpoint (run `kimi-nvfp4 convert`)", file=path
        )
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"not valid JSON ({e})", file=path) from None
