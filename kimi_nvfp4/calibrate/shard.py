"""Install calibrated `input_scale` tensors into a converted checkpoint without rewriting it (docs/formats.md §2).

All input scales go into one small extra shard, `model-input-scales.safetensors`; the index gains
their names, the quantization configs switch from weight-only (W4A16_NVFP4, what convert declares)
to W4A4 (NVFP4) once every NVFP4 linear has its scale, and the manifest records the shard and the
calibrate stage. The big shards are never touched. Order of writes (each atomic): shard, index,
hf_quant_config.json, config.json, manifest — a crash in between leaves the old or the new index,
both consistent with the files on disk, and never declares W4A4 before the scales are indexed.

Engines load every shard the index names (vLLM/SGLang `filter_duplicate_safetensors_files`), so a
tensor must live in exactly one shard: an `input_scale` already stored in a big shard is refused.
"""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from ..checkpoint.modelopt_config import ActivationScheme, nvfp4_modules_without_input_scale, set_activation_scheme
from ..checkpoint.reader import CheckpointReader
from ..checkpoint.writer import ShardWriter, WrittenShard, write_index
from ..errors import CheckpointError

INPUT_SCALES_SHARD = "model-input-scales.safetensors"
INPUT_SCALE_SUFFIX = ".input_scale"
CALIBRATE_STAGE = "calibrate"
# Stages whose results depend on the input scales and become stale when they change.
DEPENDENT_STAGES = ("validate", "serve_check", "publish")


def misplaced_input_scales(reader: CheckpointReader) -> list[str]:
    """`input_scale` tensors that live in a shard other than the calibration shard."""
    return sorted(n for n, f in reader.weight_map.items() if n.endswith(INPUT_SCALE_SUFFIX) and f != INPUT_SCALES_SHARD)


def require_no_misplaced_input_scales(reader: CheckpointReader) -> None:
    misplaced = misplaced_input_scales(reader)
    if misplaced:
        raise CheckpointError(
            f"{len(misplaced)} input_scale tensors already live in the main shards; calibrate writes them to "
            f"{INPUT_SCALES_SHARD} and a tensor may appear in only one shard",
            file=reader.root / reader.weight_map[misplaced[0]],
            tensor=misplaced[0],
        )


def _check_scales(reader: CheckpointReader, scales: dict[str, torch.Tensor]) -> None:
    for name, t in scales.items():
        if not name.endswith(INPUT_SCALE_SUFFIX):
            raise ValueError(f"{name}: only *.input_scale tensors belong in {INPUT_SCALES_SHARD}")
        module = name[: -len(INPUT_SCALE_SUFFIX)]
        if module + ".weight_scale_2" not in reader:
            raise CheckpointError(
                "no NVFP4 linear of this name in the converted checkpoint", file=reader.root, tensor=name
            )
        if t.dtype != torch.float32 or t.ndim != 0 or not bool(torch.isfinite(t)) or float(t) <= 0:
            raise ValueError(f"{name}: input_scale must be a finite, positive float32 0-d tensor, got {t}")


def install_input_scales(
    output: str | Path,
    scales: dict[str, torch.Tensor],
    *,
    stage_settings: dict[str, Any],
    stage_outputs: dict[str, Any] | None = None,
) -> WrittenShard:
    """Write the calibration shard, add its tensors to the index, record it in the manifest."""
    from ..checkpoint.manifest import ShardRecord, StageRecord, load_manifest, save_manifest

    root = Path(output)
    reader = CheckpointReader(root)
    require_no_misplaced_input_scales(reader)
    _check_scales(reader, scales)
    manifest = load_manifest(root)  # fail before writing anything if it is unreadable

    writer = ShardWriter(root / INPUT_SCALES_SHARD, metadata={"producer": "kimi-nvfp4 calibrate"})
    for name in sorted(scales):
        writer.add(name, scales[name].detach().to("cpu", torch.float32).contiguous())
    written = writer.commit()

    weight_map = {n: f for n, f in reader.weight_map.items() if f != INPUT_SCALES_SHARD}
    total = sum(reader.info(n).nbytes for n in weight_map)
    for name, t in scales.items():
        weight_map[name] = INPUT_SCALES_SHARD
        total += t.numel() * t.element_size()
    write_index(root, weight_map, total)
    if not nvfp4_modules_without_input_scale(CheckpointReader(root)):
        set_activation_scheme(root, ActivationScheme.W4A4)

    manifest.shards[INPUT_SCALES_SHARD] = ShardRecord(
        file=written.file, sha256=written.sha256, bytes=written.bytes, tensors=written.tensors
    )
    for stage in DEPENDENT_STAGES:
        manifest.stages.pop(stage, None)
    manifest.stages[CALIBRATE_STAGE] = StageRecord(
        settings=stage_settings,
        complete=True,
        finished_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        outputs={"shard": written.file, "sha256": written.sha256, "tensors": written.tensors, **(stage_outputs or {})},
    )
    save_manifest(root, manifest)
    return written
