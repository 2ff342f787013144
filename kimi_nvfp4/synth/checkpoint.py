"""Write a synthetic Kimi K2 INT4 checkpoint: the real file layout, shapes and dtypes, random contents.

Used by every stage's tests (preset `tiny`: ~42 MB, nearly all of it the 163840-row embedding and
head; pass a smaller `vocab_size` when the tokenizer is not used) and by
benchmarks (preset `k2.6`: real tensor shapes with fewer layers / experts).

Speed: `workers` processes generate and write tensors in parallel (same bytes for any number), and
`device="cuda"` draws, quantizes and packs on the GPU (other contents than the CPU's, still
deterministic per seed) for real-sized benchmarks, e.g. a 384-expert K2.6 layer. See `writing.py`.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from ..checkpoint.k2_config import K2Config
from ..checkpoint.layout import LayoutKind
from ..checkpoint.writer import write_index, write_json_atomic
from ..checkpoint_builder.config import deepseek_v3_config
from ..errors import OutputError
from .configs import KIMI_VOCAB_SIZE, PRESETS, QuantConfigPlacement, deepseek_v3_text_config, kimi_k25_config
from .tensors import CodeDistribution, TensorSpec, checkpoint_tensor_specs
from .tokenizer_files import write_remote_code_files, write_tokenizer_files
from .writing import lay_out_shards, resolve_synth_device, write_shards

KIMI_K25_PREFIX = "language_model."


def shard_file_name(index: int, count: int) -> str:
    """Moonshot's shard names: `model-00001-of-000064.safetensors` (5-digit index, 6-digit count)."""
    return f"model-{index:05d}-of-{count:06d}.safetensors"


def split_into_shards(specs: list[TensorSpec], shards: int) -> list[list[TensorSpec]]:
    """Cut the ordered tensor list into `shards` runs of about equal bytes (like save_pretrained).

    Cuts fall wherever the byte budget runs out, so an expert's gate and up (or a matrix's packed
    weight and its scale) can sit in different shards, as in the real checkpoint.
    """
    if shards < 1 or shards > len(specs):
        raise ValueError(f"shards must be in [1, {len(specs)}], got {shards}")
    total = sum(s.nbytes for s in specs)
    out: list[list[TensorSpec]] = [[]]
    done = 0
    for i, spec in enumerate(specs):
        remaining_tensors = len(specs) - i
        remaining_shards = shards - len(out)
        cut_by_budget = done >= total * len(out) / shards and out[-1]
        must_cut = remaining_tensors <= remaining_shards and out[-1]
        if remaining_shards > 0 and (cut_by_budget or must_cut):
            out.append([])
        out[-1].append(spec)
        done += spec.nbytes
    return out


class ShardLayout(str, Enum):
    """How tensors are cut into shards."""

    BYTES = "bytes"  # `shards` runs of about equal bytes, embeddings first (save_pretrained's way)
    # K2.5/K2.6's upload: decoder layer L alone in shard L+1, then embed_tokens + norm + lm_head, then the
    # projector, then the vision tower (model-00062/63/64-of-000064 for 61 layers); `shards` only asks for > 1.
    RELEASE = "release"


# The presets whose multi-shard output follows the real release's order.
RELEASE_SHARDED_PRESETS = ("k2.6",)
_VISION_GROUPS = ("mm_projector.", "vision_tower.")


def split_like_release(specs: list[TensorSpec], prefix: str, layers: int) -> list[list[TensorSpec]]:
    """Group the tensors as Moonshot's K2.5/K2.6 shards do (ShardLayout.RELEASE); empty groups are left out."""
    layer_re = re.compile(rf"^{re.escape(prefix)}model\.layers\.(\d+)\.")
    per_layer: list[list[TensorSpec]] = [[] for _ in range(layers)]
    text_tail: list[TensorSpec] = []
    vision: dict[str, list[TensorSpec]] = {g: [] for g in _VISION_GROUPS}
    for spec in specs:
        m = layer_re.match(spec.name)
        group = next((g for g in _VISION_GROUPS if spec.name.startswith(g)), None)
        if m:
            per_layer[int(m[1])].append(spec)
        elif group is not None:
            vision[group].append(spec)
        else:
            text_tail.append(spec)
    # lm_head first in the tail, as in K2.6's model-00062 (then embed_tokens and the final norm)
    text_tail.sort(key=lambda t: not t.name.endswith("lm_head.weight"))
    return [g for g in (*per_layer, text_tail, *vision.values()) if g]


@dataclass(frozen=True)
class SynthPlan:
    """Everything needed to write the checkpoint, decided before any byte is generated."""

    config: dict[str, Any]
    text: K2Config
    prefix: str
    specs: list[TensorSpec]


def plan_synthetic_checkpoint(
    *,
    preset: str = "tiny",
    layers: int | None = None,
    experts: int | None = None,
    layout: str = "kimi_k25",
    vocab_size: int = KIMI_VOCAB_SIZE,
    config_overrides: dict[str, Any] | None = None,
    quant_config_placement: QuantConfigPlacement | str | None = None,
) -> SynthPlan:
    if preset not in PRESETS:
        raise ValueError(f"preset must be one of {PRESETS}, got {preset!r}")
    kind = LayoutKind(layout)
    text_cfg = deepseek_v3_text_config(preset, layers=layers, experts=experts, vocab_size=vocab_size,
                                       overrides=config_overrides, vision=kind is LayoutKind.KIMI_K25)
    text = K2Config.from_dict(text_cfg)
    if kind is LayoutKind.KIMI_K25:
        config, prefix = kimi_k25_config(text_cfg, preset, quant_config_placement), KIMI_K25_PREFIX
        vision = config["vision_config"]
    else:
        config, prefix, vision = deepseek_v3_config(text_cfg), "", None
    return SynthPlan(config, text, prefix, checkpoint_tensor_specs(text, prefix, vision))


def create_synthetic_checkpoint(
    out_dir: str | Path,
    *,
    preset: str = "tiny",
    layers: int | None = None,
    experts: int | None = None,
    shards: int = 1,
    seed: int = 0,
    layout: str = "kimi_k25",
    code_distribution: str = "realistic",
    vocab_size: int = KIMI_VOCAB_SIZE,
    config_overrides: dict[str, Any] | None = None,
    device: str = "cpu",
    workers: int = 1,
    progress: bool = False,
    quant_config_placement: QuantConfigPlacement | str | None = None,
    shard_layout: ShardLayout | str | None = None,
) -> Path:
    """Write a K2-layout INT4 checkpoint to `out_dir` (must be absent or empty) and return its path.

    `layout`: "kimi_k25" (K2.5/K2.6 wrapper, `language_model.` prefix, vision tower) or
    "deepseek_v3" (Kimi-K2-Thinking). `config_overrides` replaces text-config keys (e.g.
    `{"q_lora_rank": None}`). Same arguments, same bytes.

    `device`: where the random tensors are drawn, quantized and packed. "cpu" (default) gives the contents
    tests pin; "cuda" uses CUDA's generator, so its contents differ from the CPU's (same shapes,
    distributions and encoding; deterministic per seed on the same GPU model and torch version); "auto"
    is cuda when available. `workers`: processes generating and writing in parallel; the files are
    byte-identical for any number (each tensor is seeded by its name). Each process holds one expert
    matrix (or 4096 rows of a BF16 tensor) at a time. Workers are spawned, so a script that calls this
    with `workers > 1` needs the usual `if __name__ == "__main__":` guard.

    `quant_config_placement`: "both" (top level and text_config) or "text_config" (only there, as K2.5/K2.6
    ship it); default: the preset's (k2.6: text_config, tiny: both). `shard_layout`: "bytes" or "release"
    (one shard per decoder layer, then embeddings + lm_head, projector, tower); default: release for the k2.6
    preset with `shards > 1`, else bytes. Remote code the config names (`configuration_kimi_k25.py`,
    `tokenization_kimi.py`) is written as stand-ins that fail loudly if anything ever runs them.
    """
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise OutputError(f"file {out}: output folder is not empty")
    dev = resolve_synth_device(device)
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    plan = plan_synthetic_checkpoint(
        preset=preset, layers=layers, experts=experts, layout=layout, vocab_size=vocab_size,
        config_overrides=config_overrides, quant_config_placement=quant_config_placement,
    )
    distribution = CodeDistribution(code_distribution)
    if shard_layout is None:
        shard_layout = ShardLayout.RELEASE if preset in RELEASE_SHARDED_PRESETS and shards > 1 else ShardLayout.BYTES
    if ShardLayout(shard_layout) is ShardLayout.RELEASE:
        groups = split_like_release(plan.specs, plan.prefix, plan.text.num_hidden_layers)
    else:
        groups = split_into_shards(plan.specs, shards)
    names = [shard_file_name(i, len(groups)) for i in range(1, len(groups) + 1)]
    out.mkdir(parents=True, exist_ok=True)
    layouts, tasks = lay_out_shards(out, groups, names)
    weight_map = {spec.name: name for group, name in zip(groups, names, strict=True) for spec in group}
    total_size = sum(s.nbytes for s in plan.specs)
    with tqdm(total=total_size, unit="B", unit_scale=True, desc="synth", disable=not progress) as bar:
        write_shards(layouts, tasks, seed=seed, distribution=distribution, device=dev, workers=workers, on_bytes=bar.update)
    write_index(out, weight_map, total_size)
    write_json_atomic(out / "config.json", plan.config)
    write_tokenizer_files(out, preset=preset)
    write_remote_code_files(out, plan.config)
    return out


def make_tiny_k2(path: str | Path, **overrides: Any) -> Path:
    """Write a tiny K2.6-layout INT4 checkpoint at `path` (the test factory behind `make_tiny_k2`).

    Keyword arguments of `create_synthetic_checkpoint` (layers, experts, shards, seed, layout,
    code_distribution, vocab_size, ...) are passed through; any other keyword overrides the text
    config (e.g. `hidden_size=96`, `q_lora_rank=None`).
    """
    params = set(inspect.signature(create_synthetic_checkpoint).parameters) - {"out_dir", "preset"}
    kwargs = {k: v for k, v in overrides.items() if k in params}
    config_overrides = {k: v for k, v in overrides.items() if k not in params}
    if config_overrides:
        kwargs["config_overrides"] = {**(kwargs.get("config_overrides") or {}), **config_overrides}
    return create_synthetic_checkpoint(path, preset="tiny", **kwargs)
