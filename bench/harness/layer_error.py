"""The served (W4A4) and W4A16 layer-local errors of requantized routed experts against the INT4 weights, summed
per input group, from one calibration's dense expert statistics (`output_aware/output_error.py`)."""

from __future__ import annotations

from pathlib import Path

import torch

NVFP4_TENSORS = ("weight", "weight_scale", "weight_scale_2")


def expert_layer_errors(stats_folder: Path, checkpoints: dict[str, Path]) -> dict[str, float]:
    """`{"<group>.<w4a4|w4a16>.<method>": summed error}` over the experts with dense statistics."""
    from kimi_nvfp4.calibrate.expert_stats_file import read_layer_stats
    from kimi_nvfp4.checkpoint.reader import CheckpointReader
    from kimi_nvfp4.demo_model import DEMO_CHECKPOINT
    from kimi_nvfp4.numerics.methods.output_aware.input_stats import ExpertInputStats
    from kimi_nvfp4.numerics.methods.output_aware.output_error import output_error
    from kimi_nvfp4.numerics.nvfp4 import NVFP4Tensor
    from kimi_nvfp4.requantize.shard import INPUT_PROJS, _int4

    source = CheckpointReader(DEMO_CHECKPOINT)
    readers = {name: CheckpointReader(folder) for name, folder in checkpoints.items()}
    totals: dict[str, float] = {}
    for path in sorted((stats_folder / "calibration" / "expert_stats").glob("*.safetensors")):
        stats = read_layer_stats(path)
        for (expert, group), served in stats.experts.items():
            if served.hessian is None:
                continue
            plain = ExpertInputStats(served.tokens, served.channel_energy, served.hessian)
            for proj in INPUT_PROJS[group]:
                module = source.layout.expert_module(stats.layer, expert, proj)
                m = _int4(source, module, torch.device("cpu"))
                for name, reader in readers.items():
                    q = NVFP4Tensor(*(reader.load(f"{module}.{s}") for s in NVFP4_TENSORS))
                    for mode, s in (("w4a4", served), ("w4a16", plain)):
                        key = f"{group}.{mode}.{name}"
                        totals[key] = totals.get(key, 0.0) + float(output_error(m, q, s))
    return totals


def relative_layer_errors(totals: dict[str, float], unit: str = "int4-aware") -> dict[str, dict[str, float]]:
    """`expert_layer_errors`' totals as `{method: {"<group>.<mode>": error / unit's}}`: each method's summed layer
    error as a multiple of `unit`'s (which must be among the checkpoints) at the same group and mode."""
    out: dict[str, dict[str, float]] = {}
    for key, value in totals.items():
        group, mode, name = key.split(".", 2)
        out.setdefault(name, {})[f"{group}.{mode}"] = value / totals[f"{group}.{mode}.{unit}"]
    return out
