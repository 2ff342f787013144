"""Write the tiny K2 as a Kimi K2.6-layout checkpoint (what Moonshot ships, at toy size).

Folder contents: `config.json` (`KimiK25ForConditionalGeneration` wrapping a DeepseekV3
`text_config`, the compressed-tensors `quantization_config` at the top level AND inside
`text_config`, docs/formats.md §1; built by kimi_nvfp4/checkpoint_builder/config.py),
`generation_config.json`, `model.safetensors.index.json`, shards `model-0000N-of-0000M.safetensors`,
and the tokenizer files. The folder is assembled under `.NAME.partial` beside the target and renamed
into place only when every file is written.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Mapping

import torch
from safetensors.torch import save

from ..checkpoint.layout import layer_of
from ..checkpoint_builder import compressed_tensors_int4_config
from ..checkpoint_builder import kimi_k25_config as builder_kimi_k25_config
from ..checkpoint_builder.tokenizer_files import MEDIA_PLACEHOLDER_TOKEN
from ..errors import OutputError
from ..checkpoint.writer import partial_path, write_bytes_atomic, write_text_atomic
from .k2_layout_export import k2_text_tensors
from .model_config import TinyK2Spec
from .specials import END_OF_TURN_TOKEN, special_id
from .tokenizer_build import CHAT_TEMPLATE_FILE, TOKENIZER_CONFIG_FILE, TOKENIZER_FILE
from .vision_stub import vision_config, vision_tensors

INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
DEFAULT_NUM_SHARDS = 2


def kimi_k25_config(spec: TinyK2Spec, vision_cfg: Mapping[str, Any]) -> dict[str, Any]:
    """config.json of the tiny K2 (no remote-code keys: the demo ships no code)."""
    text = spec.text_config(quantization_config=compressed_tensors_int4_config(vision=True))
    return builder_kimi_k25_config(text, dict(vision_cfg), token_ids=spec.token_ids(),
                                   media_placeholder_token_id=special_id(MEDIA_PLACEHOLDER_TOKEN, spec.vocab_size))


def generation_config(spec: TinyK2Spec) -> dict[str, Any]:
    # Kimi's generation_config ends generation at <|im_end|>, the end of an assistant turn.
    return {"bos_token_id": spec.token_ids()["bos_token_id"],
            "eos_token_id": special_id(END_OF_TURN_TOKEN, spec.vocab_size),
            "max_length": 4096, "do_sample": False}


def _shard_of(name: str, spec: TinyK2Spec, num_shards: int) -> int:
    layer = layer_of(name)
    if layer is None:  # embeddings first; final norm, head, vision, projector last
        return 0 if "embed_tokens" in name else num_shards - 1
    return min(num_shards - 1, layer * num_shards // spec.num_hidden_layers)


def checkpoint_tensors(state_dict: Mapping[str, torch.Tensor], spec: TinyK2Spec, seed: int) -> dict[str, torch.Tensor]:
    tensors = k2_text_tensors(state_dict)
    tensors.update(vision_tensors(vision_config(spec.hidden_size), spec.hidden_size, seed))
    return tensors


def to_json(obj: Any) -> str:
    return json.dumps(obj, indent=2, ensure_ascii=False) + "\n"


def export_checkpoint(
    state_dict: Mapping[str, torch.Tensor],
    spec: TinyK2Spec,
    tokenizer_dir: Path,
    out_dir: Path,
    *,
    seed: int = 0,
    num_shards: int = DEFAULT_NUM_SHARDS,
    extra_json: Mapping[str, Any] | None = None,
    overwrite: bool = False,
) -> Path:
    """Write the K2.6-layout INT4 checkpoint of a trained (or random) transformers state dict."""
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise OutputError(f"output folder {out_dir} is not empty (pass overwrite=True / --overwrite)")
    staging = partial_path(out_dir)
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)

    tensors = checkpoint_tensors(state_dict, spec, seed)
    shard_names = [f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors" for i in range(num_shards)]
    shards: list[dict[str, torch.Tensor]] = [{} for _ in range(num_shards)]
    for name in sorted(tensors):
        shards[_shard_of(name, spec, num_shards)][name] = tensors[name]
    weight_map: dict[str, str] = {}
    total = 0
    for file, shard in zip(shard_names, shards, strict=True):
        write_bytes_atomic(staging / file, save(shard, metadata={"format": "pt"}))
        for name, t in shard.items():
            weight_map[name] = file
            total += t.numel() * t.element_size()
    write_text_atomic(staging / INDEX_FILE, to_json({"metadata": {"total_size": total}, "weight_map": weight_map}))
    write_text_atomic(staging / CONFIG_FILE, to_json(kimi_k25_config(spec, vision_config(spec.hidden_size))))
    write_text_atomic(staging / GENERATION_CONFIG_FILE, to_json(generation_config(spec)))
    for name in (TOKENIZER_FILE, TOKENIZER_CONFIG_FILE, CHAT_TEMPLATE_FILE):
        src = Path(tokenizer_dir) / name
        if not src.is_file():
            raise OutputError(f"tokenizer folder {tokenizer_dir} lacks {name}")
        write_bytes_atomic(staging / name, src.read_bytes())
    for name, obj in (extra_json or {}).items():
        write_text_atomic(staging / name, to_json(obj))
    if out_dir.exists():
        shutil.rmtree(out_dir)
    staging.rename(out_dir)
    return out_dir

