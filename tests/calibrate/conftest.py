"""Fixtures for calibrate tests: a tiny INT4 source converted to NVFP4, and session files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from kimi_nvfp4.convert.api import convert_checkpoint
from kimi_nvfp4.synth import create_synthetic_checkpoint


def _convert_pair(root: Path, **synth) -> tuple[Path, Path]:
    src = create_synthetic_checkpoint(root / "src", preset="tiny", **synth)
    out = root / "out"
    convert_checkpoint(src, out, device="cpu", progress=False)
    return src, out


@pytest.fixture(scope="session")
def _converted_master(tmp_path_factory) -> tuple[Path, Path]:
    return _convert_pair(tmp_path_factory.mktemp("converted"), shards=2)


@pytest.fixture
def converted_pair(tmp_path, _converted_master) -> tuple[Path, Path]:
    """(INT4 source, private copy of its NVFP4 conversion without input scales)."""
    src, out = _converted_master
    dst = tmp_path / "out"
    shutil.copytree(out, dst)
    return src, dst


def session(i: int, turns: int = 1) -> dict:
    messages = [{"role": "system", "content": "You are a coding agent."}]
    for t in range(turns):
        messages += [
            {"role": "user", "content": f"Fix bug {i}.{t} in module_{i}.py please."},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": f"functions.read:{t}",
                        "type": "function",
                        "function": {"name": "read", "arguments": json.dumps({"path": f"m{i}.py"})},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": f"functions.read:{t}", "content": f"def f_{i}():\n    return {i} + {t}\n"},
            {"role": "assistant", "content": f"Done: changed line {t} of module_{i}."},
        ]
    return {"id": f"s{i}", "messages": messages}


@pytest.fixture
def sessions_jsonl(tmp_path) -> Path:
    path = tmp_path / "sessions.jsonl"
    path.write_text("".join(json.dumps(session(i, turns=1 + i % 3)) + "\n" for i in range(12)))
    return path


def quantize_dense_linears(root: Path, select) -> list[str]:
    """Rewrite the checkpoint at `root` with the BF16 linears `select(module name)` picks stored as
    NVFP4 too (each with its own weight_scale_2, no input_scale): a layout where attention (or a
    shared expert) is NVFP4, which K2.6 never has. Returns the module names converted."""
    import torch
    from safetensors.torch import save_file

    from kimi_nvfp4.checkpoint.reader import INDEX_NAME, CheckpointReader
    from kimi_nvfp4.numerics.nvfp4 import quantize_nvfp4

    reader = CheckpointReader(root)
    shards: dict[str, dict[str, torch.Tensor]] = {}
    for name, file in reader.weight_map.items():
        shards.setdefault(file, {})[name] = reader.load(name)
    reader.close()
    converted, weight_map, total = [], {}, 0
    for file, tensors in shards.items():
        out = {}
        for name, t in tensors.items():
            module = name.removesuffix(".weight")
            if name.endswith(".weight") and t.dtype == torch.bfloat16 and t.ndim == 2 and select(module):
                q = quantize_nvfp4(t.to(torch.float32))
                out[f"{module}.weight"], out[f"{module}.weight_scale"] = q.weight, q.weight_scale
                out[f"{module}.weight_scale_2"] = q.weight_scale_2.clone()
                converted.append(module)
            else:
                out[name] = t
        save_file(out, str(root / file))
        weight_map.update({n: file for n in out})
        total += sum(t.numel() * t.element_size() for t in out.values())
    index = json.loads((root / INDEX_NAME).read_text())
    index["weight_map"], index["metadata"]["total_size"] = weight_map, total
    (root / INDEX_NAME).write_text(json.dumps(index))
    return converted


@pytest.fixture
def attention_nvfp4_pair(converted_pair) -> tuple[Path, Path, list[str]]:
    """`converted_pair` with layer 0's o_proj and fused q_a/kv_a, and layer 1's shared-expert gate/up,
    stored as NVFP4 as well: (source, output, modules converted)."""
    src, out = converted_pair

    def select(module: str) -> bool:
        return module.endswith(("layers.0.self_attn.o_proj", "layers.0.self_attn.q_a_proj",
                                "layers.0.self_attn.kv_a_proj_with_mqa", "layers.1.mlp.shared_experts.gate_proj",
                                "layers.1.mlp.shared_experts.up_proj"))

    return src, out, quantize_dense_linears(out, select)
