"""Drive SGLang's own model loading over a converted checkpoint on a CPU (or the meta device) and audit it.

Order, all with SGLang's code (sglang_session.py sets up its process state):
1. `ModelConfig` from the checkpoint folder and `_get_quantization_config` (config parsing, detection
   of modelopt_fp4, the model class's `hf_to_sglang_mapper` applied to the exclude list);
2. `_initialize_model` under the target device: the quant method of every module;
3. CPU: every parameter filled with a sentinel; `DefaultModelLoader.load_weights_only` over
   SGLang's own safetensors iterator (the model's `load_weights`: name mapping, fusion, weight loaders,
   and its `post_load_weights`); meta: the same call over meta tensors shaped like the index's;
4. CPU: `process_weights_after_loading` of every quant method (sglang_postload.py), then value checks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from ..checkpoint.modelopt_config import INPUT_SCALE_SUFFIX, ActivationScheme
from ..checkpoint.reader import CheckpointReader
from .checkpoint_view import CheckpointView
from .cpu_patches import PatchLog
from .format_rules import engine_parsed_scheme, format_checks
from .load_audit import LoadRecorder, fill_sentinels, is_float, unwritten_mask
from .quant_methods import audit_methods
from .report import (
    BuildDevice,
    EngineCheckReport,
    ParameterFinding,
    ParameterVerdict,
    TensorAccounting,
    ValueCheck,
)
from .sglang_postload import run_post_load
from .sglang_session import SglangSettings, sglang_on_cpu
from .sglang_values import (
    check_expert_bytes,
    check_gate_up_input_scales,
    check_gate_up_scale_halves,
    check_kv_cache_scales,
    check_post_load,
    snapshot_input_scales,
)

# SGLang marks parameters its post-load code fills itself when the checkpoint has none (quantization/
# kv_cache.py BaseKVCacheMethod: k_scale / v_scale start at -1.0 and become 1.0 when never loaded).
ENGINE_OPTIONAL_ATTR = "_skip_weight_check"
# Parameters SGLang creates from other parameters instead of loading them (names no checkpoint holds).
DERIVED_PARAMETERS = {
    "w13_blockscale_swizzled": "built from w13_weight_scale by swizzle_blockscale (modelopt_quant.py "
    "ModelOptNvFp4FusedMoEMethod.create_weights) and rebuilt after loading on the CUTLASS path; flashinfer_trtllm "
    "creates none, Marlin repacks w13_weight_scale instead",
    "w2_blockscale_swizzled": "built from w2_weight_scale, as w13_blockscale_swizzled",
}
NVFP4_METHOD_MARKERS = ("Fp4", "NvFp4")  # ModelOptFp4LinearMethod, ModelOptNvFp4A16LinearMethod, ModelOptNvFp4FusedMoEMethod


def _is_nvfp4_method(method: object) -> bool:
    return any(m in type(method).__name__ for m in NVFP4_METHOD_MARKERS)


def _assigned_methods(model: torch.nn.Module):
    from sglang.srt.layers.radix_attention import RadixAttention

    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if method is None:
            continue
        kv = isinstance(module, RadixAttention)
        yield name, type(method).__name__, None if kv else _is_nvfp4_method(method)


def _moe_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    from sglang.srt.layers.moe.fused_moe_triton import FusedMoE

    return {n: m for n, m in model.named_modules() if isinstance(m, FusedMoE) and _is_nvfp4_method(m.quant_method)}


def _meta_weights(view: CheckpointView):
    for name, info in view.tensors.items():
        yield name, torch.empty(info.shape, dtype=info.dtype, device="meta")


@dataclass
class _Run:
    """What one check run shares between its steps."""

    report: EngineCheckReport
    view: CheckpointView
    device: BuildDevice
    log: PatchLog
    session: Any
    model: torch.nn.Module
    load_config: Any
    scheme: ActivationScheme  # what SGLang parsed (is_w4a16), not what hf_quant_config.json says

    @property
    def on_cpu(self) -> bool:
        return self.device is BuildDevice.CPU


def run_sglang_driver(view: CheckpointView, device: BuildDevice, options: Any) -> EngineCheckReport:
    """The registry's entry (engines/sglang.py): the MoE backend is chosen for the scheme SGLang will parse, which
    is config.json's block (configs/model_config.py `_parse_quant_hf_config`), not hf_quant_config.json's."""
    settings = SglangSettings.for_checkpoint(
        options.moe_runner_backend,
        weight_only=engine_parsed_scheme(view) is ActivationScheme.W4A16,
        kv_cache_fp8=view.kv_cache_quant_algo == "FP8",
    )
    return run_sglang_check(view, device, settings)


def run_sglang_check(view: CheckpointView, device: BuildDevice, settings: SglangSettings) -> EngineCheckReport:
    started = time.perf_counter()
    log = PatchLog()
    declared = view.declared_scheme
    with sglang_on_cpu(str(view.root), settings, log) as session:
        from sglang.srt.configs.load_config import LoadConfig
        from sglang.srt.layers.moe import get_moe_runner_backend
        from sglang.srt.model_loader import loader as sgl_loader

        report = EngineCheckReport(
            engine="sglang", engine_version=session.version, checkpoint=str(view.root), device=device,
            architecture=view.architecture, declared_scheme=declared.value,
        )
        report.values += format_checks(view)
        mc = session.model_config
        load_config = LoadConfig(load_format="auto")
        try:
            quant_config = sgl_loader._get_quantization_config(mc, load_config)
        except Exception as e:  # SGLang refuses the quantization config: the server would not start either
            report.errors.append(f"_get_quantization_config raised {type(e).__name__}: {e}")
            return _finish(report, log, started)
        report.ran.append("ModelConfig.from_server_args + model_loader.loader._get_quantization_config")
        report.engine_view = {
            "quantization": str(mc.quantization),
            "quant config": type(quant_config).__name__,
            "weight-only (is_w4a16)": str(getattr(quant_config, "is_w4a16", "?")),
            "kv_cache_quant_algo": str(getattr(quant_config, "kv_cache_quant_algo", None)),
            "group_size": str(getattr(quant_config, "group_size", "?")),
            "exclude entries after apply_weight_name_mapper": str(len(getattr(quant_config, "exclude_modules", []))),
        }
        backend = get_moe_runner_backend()
        report.settings = {
            "moe runner backend": str(getattr(backend, "value", backend)),
            "attention backend": str(session.server_args.attention_backend),
            "kv cache dtype": str(session.server_args.kv_cache_dtype),
            "tensor parallel size": str(session.server_args.tp_size),
        }
        try:
            with sgl_loader.set_default_torch_dtype(mc.dtype), torch.device(device.value):
                model = sgl_loader._initialize_model(mc, load_config, quant_config)
        except Exception as e:  # e.g. a config key SGLang's model reads is missing
            report.errors.append(f"SGLang could not build the model: {type(e).__name__}: {e}")
            return _finish(report, log, started)
        report.ran.append(f"model_loader.loader._initialize_model on {device.value} ({type(model).__name__})")
        packed = dict(getattr(quant_config, "packed_modules_mapping", None) or {})
        report.modules = audit_methods(
            _assigned_methods(model), view.nvfp4_modules, packed, kv_cache_declared=view.kv_cache_quant_algo is not None
        )
        if report.modules.mismatches:
            report.not_run.append("weight loading: skipped, the engine would build parameters for another format")
        else:
            # the scheme SGLang will serve: its own parse (config.json first), which may differ from hf_quant_config.json
            scheme = ActivationScheme.W4A16 if getattr(quant_config, "is_w4a16", False) else ActivationScheme.W4A4
            _load_and_audit(_Run(report, view, device, log, session, model, load_config, scheme))
    return _finish(report, log, started)


def _finish(report: EngineCheckReport, log: PatchLog, started: float) -> EngineCheckReport:
    report.patches = log.patches
    report.seconds = time.perf_counter() - started
    return report


def _load_and_audit(run: _Run) -> None:
    from sglang.srt.model_loader import loader as sgl_loader
    from sglang.srt.model_loader.weight_utils import default_weight_loader

    report, view, model, declared = run.report, run.view, run.model, run.scheme
    params = dict(model.named_parameters(remove_duplicate=False))
    report.parameters_total = len(params)
    optional = {n for n, p in params.items() if getattr(p, ENGINE_OPTIONAL_ATTR, False)}
    engine_defaults = {n: params[n].detach().clone() for n in optional} if run.on_cpu else {}
    if run.on_cpu:
        fill_sentinels(params)
    recorder = LoadRecorder(params, measure_landing=run.on_cpu)
    recorder.install(default_weight_loader)
    loader = sgl_loader.DefaultModelLoader(run.load_config)
    target = torch.device(run.device.value)
    try:
        weights = loader._get_all_weights(run.session.model_config, model) if run.on_cpu else _meta_weights(view)
        try:
            sgl_loader.DefaultModelLoader.load_weights_only(model, recorder.watch(weights), target)
        except Exception as e:
            report.errors.append(f"loading raised {type(e).__name__}: {e}")
            return
        report.ran.append(
            "DefaultModelLoader.load_weights_only -> the model's load_weights (name mapping, fusion, weight loaders, "
            "post_load_weights)" + (" over SGLang's safetensors iterator" if run.on_cpu else " over meta tensors shaped "
                                    "like the index's")
        )
        fused, unexplained = recorder.attribute_fused()
        if run.on_cpu:
            unwritten = _unwritten(params, recorder, loader, run, target)
        else:
            called = recorder.called_parameters()
            unwritten = {n: p.numel() for n, p in params.items() if n not in called}
    finally:
        recorder.uninstall()
    read, routed, indexed = recorder.read, recorder.routed(), set(view.tensors)
    report.tensors = TensorAccounting(
        in_checkpoint=len(indexed), read=len(read), routed=len(routed & set(read)),
        not_read=sorted(indexed - set(read)), read_not_indexed=sorted(set(read) - indexed),
        dropped=sorted(set(read) - routed), fused=fused,
    )
    report.parameters_written = len(params) - len(unwritten)
    findings = {n: _classify(n, params[n], count, optional, declared) for n, count in unwritten.items()}
    if run.on_cpu:
        moe_layers = _moe_layers(model)
        _value_checks_after_load(run, recorder, fused, unexplained, moe_layers)
        recorder.release()
        loaded_scales = snapshot_input_scales(moe_layers)
        with torch.no_grad():
            for n in optional & set(unwritten):
                params[n].data.copy_(engine_defaults[n])
        post = run_post_load(model, run.log, set(unwritten) - optional)
        report.ran.append(f"process_weights_after_loading of {post.processed} modules (every quant method)")
        report.errors += post.errors
        for name, calls in post.kernel_steps_skipped.items():
            report.not_run.append(f"{name} ({calls} calls): GPU kernel, replaced by a recorder")
        _mark_consumed(findings, post.tainted)
        report.values += check_post_load(moe_layers, loaded_scales)
        report.values += check_kv_cache_scales(model, CheckpointReader(view.root))
    else:
        recorder.release()
        report.not_run += [
            "sentinel audit and value checks: meta tensors hold no values (a parameter counts as written when a "
            "weight loader received a tensor for it; partly written parameters are not detected)",
            "process_weights_after_loading: needs values",
        ]
    report.parameter_findings = sorted(findings.values(), key=lambda f: (f.verdict.value, f.parameter))


def _value_checks_after_load(run: _Run, recorder: LoadRecorder, fused, unexplained, moe_layers) -> None:
    failed = [c for c in recorder.calls if c.landed is False]
    measured = [c for c in recorder.calls if c.landed is not None]
    run.report.values.append(ValueCheck(
        name="floating tensors land bit for bit (sentinel diff per loader call)", passed=not failed,
        checked=len(measured),
        detail=f"{len(measured)} loader calls" if not failed
        else "; ".join(f"{c.parameter} <- {c.sources}: {c.detail}" for c in failed[:5]),
    ))
    reader = CheckpointReader(run.view.root)
    run.report.values.append(ValueCheck(
        name="model-built tensors = concatenation of checkpoint tensors (fused loads)", passed=not unexplained,
        checked=len(fused) + len(unexplained),
        detail="; ".join(f"{p.rsplit('.', 2)[-2]} <- {', '.join(n.rsplit('.', 2)[-2] for n in parts)}"
                         for p, parts in list(fused.items())[:1]) + f" ({len(fused)} parameters)"
        if not unexplained else f"no checkpoint tensors explain the loads of {unexplained[:5]}",
    ))
    run.report.values.append(check_expert_bytes(moe_layers, reader))
    run.report.values.append(check_gate_up_scale_halves(moe_layers))
    if run.scheme is ActivationScheme.W4A4:
        run.report.values.append(check_gate_up_input_scales(moe_layers, reader))


def _unwritten(params, recorder: LoadRecorder, loader, run: _Run, target: torch.device) -> dict[str, int]:
    """Elements never written per parameter (sentinels; integer parameters loaded twice, see load_audit.py)."""
    from sglang.srt.model_loader import loader as sgl_loader

    masks = {n: unwritten_mask(p) for n, p in params.items()}
    suspects = {n for n, m in masks.items() if not is_float(params[n]) and bool(m.any())}
    if suspects:
        names = recorder.names_routed_to(suspects)
        first_calls = list(recorder.calls)
        fill_sentinels(params, which=1, names=suspects)
        again = ((n, t) for n, t in loader._get_all_weights(run.session.model_config, run.model) if n in names)
        sgl_loader.DefaultModelLoader.load_weights_only(run.model, again, target)
        for n in suspects:
            masks[n] = masks[n] & unwritten_mask(params[n], which=1)
        recorder.calls[:] = first_calls
        run.report.ran.append(f"a second load of the {len(names)} tensors routed to integer parameters (sentinel 0)")
    return {n: int(m.sum()) for n, m in masks.items() if bool(m.any())}


def _classify(name, param, count, optional, declared) -> ParameterFinding:
    base = {"parameter": name, "dtype": str(param.dtype).removeprefix("torch."), "shape": list(param.shape),
            "unwritten": count, "numel": param.numel()}
    leaf = name.rsplit(".", 1)[-1]
    if leaf in DERIVED_PARAMETERS:
        return ParameterFinding(**base, verdict=ParameterVerdict.DERIVED, reason=DERIVED_PARAMETERS[leaf])
    if name in optional:
        return ParameterFinding(**base, verdict=ParameterVerdict.ENGINE_DEFAULT,
                                reason="optional in SGLang (_skip_weight_check): its post-load code uses 1.0")
    if name.endswith(INPUT_SCALE_SUFFIX.lstrip(".")) and declared is ActivationScheme.W4A16:
        return ParameterFinding(**base, verdict=ParameterVerdict.UNUSED,
                                reason="SGLang parsed the checkpoint as weight-only: activation scales are not part of it")
    return ParameterFinding(**base, verdict=ParameterVerdict.MISS, reason="no checkpoint tensor reached it")


def _mark_consumed(findings: dict[str, ParameterFinding], tainted: dict[str, list[str]]) -> None:
    for name, f in findings.items():
        module = name.rsplit(".", 1)[0]
        if module in tainted and f.verdict is ParameterVerdict.UNUSED:
            f.verdict = ParameterVerdict.MISS
            f.reason = (f"weight-only checkpoint, but this MoE backend quantizes activations with it: "
                        f"{', '.join(tainted[module])} computed from the never-written value (serve weight-only "
                        f"checkpoints with --moe-runner-backend marlin)")
