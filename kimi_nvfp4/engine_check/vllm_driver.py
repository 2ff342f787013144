"""vLLM 0.33's own rules over a converted checkpoint, as far as its CUDA wheel runs on a CPU.

vLLM's CUDA build imports on CPU-only torch (its `_C` extension fails to load and is skipped) but
cannot construct its layers (VllmConfig, platform and kernel selection need a device), so the model
is not built. What runs, all from the installed package:
- `ModelOptNvFp4Config.override_quantization_method` and `from_config` on config.json's
  quantization_config and on hf_quant_config.json (its W4A16 routing: `_from_config` turns a
  checkpoint whose `input_activations` are all null into W4A16_NVFP4);
- `apply_vllm_mapper(KimiK25ForConditionalGeneration.hf_to_vllm_mapper)` on the exclude list and
  `hf_to_vllm_mapper.map_name` on every tensor name;
- `get_quant_method(layer, prefix)` for every linear module vLLM builds (a bare `LinearBase` /
  `ParallelLMHead` instance carries the isinstance check) and `is_layer_excluded` for every
  FusedMoE, with DeepseekV2's `packed_modules_mapping` (plus the `fused_qkv_a_proj` entry its
  `__init__` adds when q_lora_rank is set);
- `RoutedExperts.build_expert_params_mapping` over every routed-expert tensor.
Module prefixes are the mapped tensor names without their parameter leaf, fused per packed mapping,
experts grouped under `...mlp.experts` (the FusedMoE's prefix); the router `mlp.gate` is built
without a quant config and `embed_tokens` never asks (restated from models/deepseek_v2.py).
"""

from __future__ import annotations

import importlib.metadata
import time

from ..checkpoint.layout import parse_expert_name
from ..checkpoint.modelopt_config import INPUT_SCALE_SUFFIX, QUANT_ALGO_W4A16_NVFP4, ActivationScheme
from ..errors import EngineUnavailableError
from .checkpoint_view import CheckpointView
from .cpu_patches import PatchLog, ensure_torchvision
from .quant_methods import audit_methods
from .format_rules import format_checks
from .report import BuildDevice, EngineCheckReport, TensorAccounting, ValueCheck

VLLM_TESTED_VERSION = "0.33.0"
WEIGHT_LEAF = ".weight"
UNBUILT_BY_QUANT_CONFIG = ("mlp.gate", "embed_tokens")  # vLLM builds these without asking the quant config
FUSED_QKV_A = ("fused_qkv_a_proj", ["q_a_proj", "kv_a_proj_with_mqa"])  # DeepseekV2ForCausalLM.__init__


def _import_vllm(log: PatchLog):
    try:
        version = importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        raise EngineUnavailableError("vLLM is not installed: see docs/engine_check.md for the --no-deps install") from None
    ensure_torchvision(log)
    try:
        from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
        from vllm.model_executor.layers.linear import LinearBase
        from vllm.model_executor.layers.quantization import modelopt
        from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
        from vllm.model_executor.models.deepseek_v2 import DeepseekV3ForCausalLM
        from vllm.model_executor.models.kimi_k25 import KimiK25ForConditionalGeneration
    except ImportError as e:
        raise EngineUnavailableError(f"vLLM {version} does not import on this machine: {e}") from e
    return version, modelopt, KimiK25ForConditionalGeneration, DeepseekV3ForCausalLM, RoutedExperts, LinearBase, ParallelLMHead


def run_vllm_check(view: CheckpointView, device: BuildDevice, options: object = None) -> EngineCheckReport:
    """vLLM's config, mapping and exclusion rules over `view` (`options`: none, the plugin's NoOptions)."""
    started = time.perf_counter()
    log = PatchLog()
    version, modelopt, kimi_k25, deepseek_v3, routed_experts, linear_base, lm_head = _import_vllm(log)
    declared = view.declared_scheme
    report = EngineCheckReport(
        engine="vllm", engine_version=version, checkpoint=str(view.root), device=device,
        architecture=view.architecture, declared_scheme=declared.value,
    )
    report.values += format_checks(view)
    block = view.config.get("quantization_config") or {}
    config_cls = modelopt.ModelOptNvFp4Config
    method = config_cls.override_quantization_method(block, None)
    quant_config = config_cls.from_config(block)
    from_hf = config_cls.from_config(view.hf_quant_config)
    report.ran.append("ModelOptNvFp4Config.override_quantization_method and from_config (config.json, hf_quant_config.json)")
    report.engine_view = {
        "quantization": str(method),
        "quant_algo (quant_method)": quant_config.quant_method,
        "kv_cache_quant_algo": str(quant_config.kv_cache_quant_algo),
        "group_size": str(quant_config.group_size),
        "exclude entries before apply_vllm_mapper": str(len(quant_config.exclude_modules)),
    }
    weight_only = quant_config.quant_method == QUANT_ALGO_W4A16_NVFP4
    report.values.append(ValueCheck(
        name="vLLM reads the declared activation scheme (W4A16_NVFP4 <=> input_activations all null)",
        passed=weight_only == (declared is ActivationScheme.W4A16) and from_hf.quant_method == quant_config.quant_method
        and sorted(from_hf.exclude_modules) == sorted(quant_config.exclude_modules),
        checked=2, detail=f"config.json -> {quant_config.quant_method}, hf_quant_config.json -> {from_hf.quant_method}; "
        f"declared {declared.value}",
    ))
    if not weight_only:
        missing = [m for m in view.nvfp4_modules if m + INPUT_SCALE_SUFFIX not in view.tensors]
        report.values.append(ValueCheck(
            name="W4A4: every NVFP4 linear ships input_scale (vLLM's W4A4 MoE folds it; unloaded it is uninitialised)",
            passed=not missing, checked=len(view.nvfp4_modules),
            detail=f"{len(view.nvfp4_modules)} NVFP4 linears" if not missing else f"{len(missing)} without, e.g. {missing[0]}",
        ))

    packed = dict(deepseek_v3.packed_modules_mapping)
    if (view.config.get("text_config") or view.config).get("q_lora_rank") is not None:
        packed[FUSED_QKV_A[0]] = FUSED_QKV_A[1]
    quant_config.packed_modules_mapping = packed
    mapper = kimi_k25.hf_to_vllm_mapper
    quant_config.apply_vllm_mapper(mapper)
    report.ran.append("apply_vllm_mapper(KimiK25ForConditionalGeneration.hf_to_vllm_mapper) on the exclude list")
    report.engine_view["exclude entries after apply_vllm_mapper"] = str(len(quant_config.exclude_modules))

    mapped = {name: mapper.map_name(name) for name in view.tensors}
    report.ran.append(f"hf_to_vllm_mapper.map_name over {len(mapped)} tensor names")
    kept = {n: m for n, m in mapped.items() if m is not None}
    n_experts = max((p.expert for n in view.tensors if (p := parse_expert_name(n)) is not None), default=-1) + 1
    expert_map = routed_experts.build_expert_params_mapping("gate_proj", "down_proj", "up_proj", n_experts)
    report.ran.append(f"RoutedExperts.build_expert_params_mapping for {n_experts} experts")
    # DeepseekV2.load_weights renames an expert tensor by the first entry whose weight_name is in its name
    weight_names = {w for _, w, _, _ in expert_map}
    unmapped_experts = [
        n for n in kept if (p := parse_expert_name(n)) is not None and f"experts.{p.expert}.{p.proj}." not in weight_names
    ]
    report.tensors = TensorAccounting(
        # read = 0: no weight iterator or loader runs, so "not read" and "never written" are not measured here
        in_checkpoint=len(view.tensors), read=0, routed=len(kept) - len(unmapped_experts),
        dropped=sorted([n for n, m in mapped.items() if m is None] + unmapped_experts),
        routing="NAME RULES ONLY: kept by hf_to_vllm_mapper (experts: matched by the expert params mapping); no "
        "weight loader ran, so a tensor no vLLM parameter takes is not detected",
    )

    assigned = list(_assigned(kept, view, quant_config, packed, linear_base, lm_head))
    report.ran.append(f"get_quant_method / is_layer_excluded for {len(assigned)} modules")
    nvfp4 = sorted({mapper.map_name(m + WEIGHT_LEAF)[: -len(WEIGHT_LEAF)] for m in view.nvfp4_modules})
    report.modules = audit_methods(assigned, nvfp4, packed, kv_cache_declared=True)
    report.not_run = [
        "model construction, weight loaders, process_weights_after_loading: vLLM's CUDA wheel cannot build its "
        "layers on a CPU-only torch (VllmConfig, platform and kernel selection); no parameter is allocated, so "
        "no sentinel audit",
        "KV-cache methods: vLLM gives every attention one; not compared",
    ]
    report.patches = log.patches
    report.seconds = time.perf_counter() - started
    return report


def _assigned(kept, view, quant_config, packed, linear_base, lm_head):
    """(module prefix, vLLM method class, treated as NVFP4) for every linear and FusedMoE vLLM builds."""
    fused_of = {shard: fused for fused, shards in packed.items() for shard in shards}
    modules: dict[str, str] = {}
    for name, vname in kept.items():
        info = view.tensors[name]
        expert = parse_expert_name(name)
        if expert is not None:
            modules[vname.split(".experts.")[0] + ".experts"] = "moe"
            continue
        if not vname.endswith(WEIGHT_LEAF) or len(info.shape) != 2:
            continue
        module = vname[: -len(WEIGHT_LEAF)]
        if module.endswith(UNBUILT_BY_QUANT_CONFIG):
            continue
        parent, _, leaf = module.rpartition(".")
        if leaf in fused_of:
            module = f"{parent}.{fused_of[leaf]}"
        modules[module] = "lm_head" if leaf == "lm_head" else "linear"
    for module, kind in sorted(modules.items()):
        if kind == "moe":
            excluded = quant_config.is_layer_excluded(module)
            name = "UnquantizedFusedMoEMethod" if excluded else quant_config.FusedMoEMethodCls.__name__
            yield module, name, not excluded
            continue
        layer = (lm_head if kind == "lm_head" else linear_base).__new__(lm_head if kind == "lm_head" else linear_base)
        method = quant_config.get_quant_method(layer, module)
        name = type(method).__name__
        yield module, name, not name.startswith("Unquantized")
