"""Does the quant method an engine gave each module agree with what the checkpoint holds for it?

The engine decides per module, from its quantization config and the names it builds
(`get_quant_method(layer, prefix)`); the checkpoint decides by what it stores: a module is NVFP4
when a `weight_scale_2` exists for it, or for one of the checkpoint modules the engine fuses into it
(the engine's `packed_modules_mapping`, e.g. gate_proj + up_proj -> gate_up_proj), or for a module
under it (the routed experts under a FusedMoE). An NVFP4 module given an unquantized method would
load packed bytes as BF16; a BF16 module given an NVFP4 method would expect tensors that do not exist.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from .report import ModuleMethods

KV_CACHE = "kv_cache"


def _with_ancestors(modules: Iterable[str]) -> set[str]:
    """Every module and every dotted prefix of it (a FusedMoE `...mlp.experts` holds `...mlp.experts.0.up_proj`)."""
    out: set[str] = set()
    for m in modules:
        parts = m.split(".")
        out.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return out


def holds_nvfp4(module: str, nvfp4_and_ancestors: set[str], packed: Mapping[str, list[str]]) -> bool:
    """Whether the checkpoint holds NVFP4 tensors for engine module `module` (see the module docstring)."""
    parent, _, leaf = module.rpartition(".")
    names = [f"{parent}.{shard}" if parent else shard for shard in packed.get(leaf, [])] or [module]
    return any(n in nvfp4_and_ancestors for n in names)


def audit_methods(
    assigned: Iterable[tuple[str, str, bool | None]],
    nvfp4_modules: Iterable[str],
    packed: Mapping[str, list[str]],
    *,
    kv_cache_declared: bool,
) -> ModuleMethods:
    """`assigned`: (module, engine method class, engine treats it as NVFP4 — None for a KV-cache method)."""
    nvfp4 = _with_ancestors(nvfp4_modules)
    out = ModuleMethods()
    for module, method, engine_nvfp4 in assigned:
        out.by_method[method] = out.by_method.get(method, 0) + 1
        if engine_nvfp4 is None:  # an attention's KV-cache method: present iff the config declares a quantized cache
            if not kv_cache_declared:
                out.mismatches.append(f"{module}: engine {method}, but the checkpoint declares no KV-cache quantization")
            continue
        holds = holds_nvfp4(module, nvfp4, packed)
        out.nvfp4_modules += holds
        if holds != engine_nvfp4:
            what = "NVFP4 tensors" if holds else "no NVFP4 tensor (BF16)"
            out.mismatches.append(f"{module}: engine {method}, checkpoint holds {what}")
    return out
