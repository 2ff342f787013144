"""Pre-flight checks shared by calibrate and validate: is OUTPUT a converted NVFP4 checkpoint,
and is SOURCE the INT4 checkpoint it was converted from?

Both run before anything is computed or written, and read only headers and a few small tensors.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..checkpoint.layout import parse_expert_name
from ..checkpoint.modelopt_config import NVFP4_QUANT_ALGOS
from ..checkpoint.reader import CheckpointReader
from ..errors import CheckpointError, UnsupportedCheckpointError

HF_QUANT_CONFIG_NAME = "hf_quant_config.json"
NVFP4_QUANT_ALGO = "NVFP4"
MODELOPT_QUANT_METHOD = "modelopt"
COMPRESSED_TENSORS_QUANT_METHOD = "compressed-tensors"
# Expert tensor suffixes that only exist in one of the two formats.
INT4_EXPERT_SUFFIXES = ("weight_packed", "weight_shape")
NVFP4_EXPERT_SUFFIXES = ("weight", "weight_scale", "weight_scale_2")
# Sources and outputs must agree bit for bit on these small BF16/FP32 tensors (per layer suffixes).
_FINGERPRINT_LAYER_SUFFIXES = ("input_layernorm.weight", "mlp.gate.e_score_correction_bias")


def read_hf_quant_config(root: Path) -> dict:
    path = root / HF_QUANT_CONFIG_NAME
    if not path.is_file():
        raise UnsupportedCheckpointError(
            f"{HF_QUANT_CONFIG_NAME} is missing: this is not a converted NVFP4 checkpoint "
            "(run `kimi-nvfp4 convert` first)",
            file=path,
        )
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"not valid JSON ({e})", file=path) from None
    if not isinstance(data, dict) or not isinstance(data.get("quantization"), dict):
        what = type(data).__name__ if not isinstance(data, dict) else f"quantization {type(data.get('quantization')).__name__}"
        raise CheckpointError(f"expected a JSON object with a \"quantization\" object (ModelOpt's hf_quant_config "
                              f"format), got a {what}", file=path)
    algo = data["quantization"].get("quant_algo")
    if algo not in NVFP4_QUANT_ALGOS:  # W4A16_NVFP4 until calibrate has installed the input scales
        raise UnsupportedCheckpointError(
            f"quantization.quant_algo is {algo!r}, expected one of {NVFP4_QUANT_ALGOS}", file=path
        )
    return data


def require_converted(output: CheckpointReader) -> None:
    """Raise unless `output` looks like a finished `kimi-nvfp4 convert` output."""
    from ..checkpoint.manifest import load_manifest

    read_hf_quant_config(output.root)
    qc = output.config.get("quantization_config") or {}
    if qc.get("quant_method") != MODELOPT_QUANT_METHOD:
        raise UnsupportedCheckpointError(
            f"quantization_config.quant_method is {qc.get('quant_method')!r}, expected "
            f"{MODELOPT_QUANT_METHOD!r}: this is not a converted NVFP4 checkpoint (run `kimi-nvfp4 convert` first)",
            file=output.root / "config.json",
        )
    manifest = load_manifest(output.root)
    if not manifest.complete:
        raise CheckpointError(
            "the conversion manifest says the conversion did not finish (re-run `kimi-nvfp4 convert`)",
            file=output.root,
        )
    for name in output.weight_map:
        parsed = parse_expert_name(name)
        if parsed is not None and parsed.suffix in INT4_EXPERT_SUFFIXES:
            raise UnsupportedCheckpointError(
                "an INT4 expert tensor is still present: this checkpoint was not (fully) converted",
                file=output.root / output.weight_map[name],
                tensor=name,
            )


def require_int4_source(source: CheckpointReader) -> None:
    if not any((p := parse_expert_name(n)) is not None and p.suffix == "weight_packed" for n in source.weight_map):
        raise UnsupportedCheckpointError(
            "no INT4 expert tensors (`*.weight_packed`): SOURCE must be the INT4 checkpoint that was converted",
            file=source.root,
        )


def _quantized_from_bf16(name: str, a, b, output: CheckpointReader) -> bool:
    """A BF16 source `.weight` that convert quantized to NVFP4 (`--shared-experts nvfp4`): uint8 [out, in/2] with
    its `weight_scale_2` beside it."""
    module = name.removesuffix(".weight")
    return (
        name.endswith(".weight") and f"{module}.weight_scale_2" in output and a.dtype.is_floating_point
        and b.dtype == torch.uint8 and len(a.shape) == 2 and list(b.shape) == [a.shape[0], a.shape[1] // 2]
    )


def require_matching_source(source: CheckpointReader, output: CheckpointReader) -> None:
    """Raise unless `source` is the INT4 checkpoint `output` was converted from.

    Compares the model hyper-parameters, the layout, the set of non-expert tensors with their
    shapes and dtypes, and a fingerprint of small tensors (norms, router biases) bit for bit.
    """
    require_int4_source(source)
    if source.layout.kind != output.layout.kind:
        raise CheckpointError(
            f"source layout {source.layout.kind.value} does not match the converted checkpoint's "
            f"{output.layout.kind.value}",
            file=source.root / "config.json",
        )
    src_cfg, out_cfg = source.layout.text.to_dict(), output.layout.text.to_dict()
    diff = sorted(k for k in src_cfg if src_cfg[k] != out_cfg.get(k))
    if diff:
        k = diff[0]
        raise CheckpointError(
            f"source does not match the converted checkpoint: {k} is {src_cfg[k]!r} in the source but "
            f"{out_cfg.get(k)!r} in the output ({len(diff)} keys differ)",
            file=source.root / "config.json",
        )
    src_plain = {n for n in source.weight_map if parse_expert_name(n) is None}
    out_plain = {n for n in output.weight_map if parse_expert_name(n) is None}
    missing = sorted(src_plain - out_plain)
    if missing:
        raise CheckpointError(
            f"source does not match the converted checkpoint: the output lacks {len(missing)} of the "
            "source's non-expert tensors",
            file=output.root,
            tensor=missing[0],
        )
    for name in sorted(src_plain):
        a, b = source.info(name), output.info(name)
        if _quantized_from_bf16(name, a, b, output):
            continue
        if a.shape != b.shape or a.dtype != b.dtype:
            raise CheckpointError(
                f"source does not match the converted checkpoint: source has {a.dtype} {list(a.shape)}, "
                f"output has {b.dtype} {list(b.shape)}",
                file=output.root / b.file,
                tensor=name,
            )
    for name in fingerprint_names(source):
        if not torch.equal(source.load(name), output.load(name)):
            raise CheckpointError(
                "source does not match the converted checkpoint: this tensor differs bit for bit",
                file=output.root / output.weight_map[name],
                tensor=name,
            )


def fingerprint_names(reader: CheckpointReader) -> list[str]:
    """Small tensors that identify a checkpoint's weights: final norm, per-layer norms, router biases."""
    layout = reader.layout
    names = [layout.final_norm_name]
    for layer in range(layout.text.num_hidden_layers):
        for suffix in _FINGERPRINT_LAYER_SUFFIXES:
            names.append(layout.layer_prefix(layer) + suffix)
    return [n for n in names if n in reader]
