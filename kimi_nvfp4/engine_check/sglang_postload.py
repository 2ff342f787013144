"""SGLang's post-load processing (`process_weights_after_loading` of every quant method), run on a CPU.

What runs is SGLang's own code: for the NVFP4 MoE method the gate/up `weight_scale_2` handling
(`_compute_gemm1_alphas`: TRT-LLM/CUTLASS keep both halves as g1_alphas / g1_alphas_up, Marlin keeps
gate's), the reduction of the experts' input scales (max over all experts on the flashinfer
backends), the weight-scale shape asserts, the TRT-LLM intermediate-size padding and its GEMM1
output scale; the KV-cache method's k/v scale defaults. Only the steps that are GPU kernels are
replaced, each by a recorder that leaves the tensors as they are (logged as CpuPatches):
- FlashInfer's TRT-LLM weight/scale shuffle (`prepare_static_weights_for_trtllm_fp4_moe`): a
  permutation of rows and block scales for the kernel's layout; no value changes.
- `reorder_rows_for_gated_act_gemm` / `shuffle_matrix_sf_a`: SGLang takes its TRT-LLM branch only when
  these FlashInfer imports exist (modelopt_quant.py), else it silently takes the CUTLASS branch; on a
  machine without FlashInfer they are stand-ins that raise if called (the shuffle above is what calls them).
- Marlin's repack (`prepare_moe_nvfp4_layer_for_marlin`): GPU kernels that re-tile weights and scales.

Never-written elements still hold NaN here (except parameters the engine marks optional, which get
their engine default back), so a derived tensor that comes out with NaN proves the engine consumed
a value the checkpoint never provided.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field

import torch

from .cpu_patches import PatchLog
from .load_audit import nan_mask


@dataclass
class PostLoadResult:
    processed: int = 0
    errors: list[str] = field(default_factory=list)
    # module -> derived tensors holding NaN after processing (computed from never-written values)
    tainted: dict[str, list[str]] = field(default_factory=dict)
    kernel_steps_skipped: dict[str, int] = field(default_factory=dict)


def _flashinfer_kernel(name: str):
    def call(*args, **kwargs):
        raise RuntimeError(f"FlashInfer kernel {name} called inside the CPU engine check")

    return call


@contextmanager
def kernel_stand_ins(log: PatchLog, result: PostLoadResult) -> Iterator[None]:
    import sglang.srt.layers.quantization.modelopt_quant as modelopt_quant
    import sglang.srt.layers.quantization.utils as quant_utils

    def shuffle_unchanged(gemm1_weights, gemm2_weights, gemm1_scales, gemm2_scales, *args, **kwargs):
        result.kernel_steps_skipped["prepare_static_weights_for_trtllm_fp4_moe"] = (
            result.kernel_steps_skipped.get("prepare_static_weights_for_trtllm_fp4_moe", 0) + 1
        )
        return gemm1_weights, gemm1_scales, gemm2_weights, gemm2_scales

    def marlin_repack_skipped(layer):
        result.kernel_steps_skipped["prepare_moe_nvfp4_layer_for_marlin"] = (
            result.kernel_steps_skipped.get("prepare_moe_nvfp4_layer_for_marlin", 0) + 1
        )

    with ExitStack() as stack:
        stack.enter_context(
            log.attribute(
                quant_utils, "prepare_static_weights_for_trtllm_fp4_moe", shuffle_unchanged,
                target="sglang.srt.layers.quantization.utils.prepare_static_weights_for_trtllm_fp4_moe",
                why="FlashInfer's TRT-LLM FP4 MoE shuffle is GPU code (nvfp4_block_scale_interleave, permute indices)",
                effect="weights and block scales keep the canonical layout; everything around it in "
                "process_weights_after_loading runs (padding, alphas, g1_scale_c)",
            )
        )
        for name in ("reorder_rows_for_gated_act_gemm", "shuffle_matrix_sf_a"):
            if getattr(modelopt_quant, name, None) is None:
                stack.enter_context(
                    log.attribute(
                        modelopt_quant, name, _flashinfer_kernel(name),
                        target=f"sglang.srt.layers.quantization.modelopt_quant.{name}",
                        why="FlashInfer is not installed (CUDA only); SGLang tests these names to pick its "
                        "TRT-LLM branch over the CUTLASS one",
                        effect="the flashinfer_trtllm branch is taken as on a B200; the stand-in raises if called",
                    )
                )
        stack.enter_context(
            log.attribute(
                modelopt_quant, "prepare_moe_nvfp4_layer_for_marlin", marlin_repack_skipped,
                target="sglang.srt.layers.quantization.modelopt_quant.prepare_moe_nvfp4_layer_for_marlin",
                why="Marlin's FP4 repack runs GPU kernels",
                effect="only with --moe-runner-backend marlin: the scale handling before it runs, the repack does not",
            )
        )
        yield


def _tensors_of(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    seen: set[int] = set()
    for name, t in [*module._parameters.items(), *module._buffers.items(), *vars(module).items()]:
        if isinstance(t, torch.Tensor) and id(t) not in seen and t.dtype.is_floating_point and t.device.type != "meta":
            seen.add(id(t))
            yield name, t


def run_post_load(model: torch.nn.Module, log: PatchLog, unwritten_params: set[str]) -> PostLoadResult:
    """`process_weights_after_loading` of every module with a quant method; NaN scan of the modules that had
    never-written parameters (`unwritten_params`: full parameter names)."""
    from sglang.srt.model_loader.loader import _modules_with_quant_method

    result = PostLoadResult()
    names = {id(m): n for n, m in model.named_modules()}
    watched = {p.rsplit(".", 1)[0] for p in unwritten_params}
    with kernel_stand_ins(log, result):
        for module, quant_method in _modules_with_quant_method(model):
            name = names.get(id(module), "?")
            try:
                quant_method.process_weights_after_loading(module)
            except Exception as e:  # a raise here would stop the server's start-up too
                result.errors.append(f"{name}: {type(quant_method).__name__}.process_weights_after_loading: "
                                     f"{type(e).__name__}: {e}")
                continue
            result.processed += 1
            if name in watched:
                own = {p.rsplit(".", 1)[1] for p in unwritten_params if p.rsplit(".", 1)[0] == name}
                bad = [t_name for t_name, t in _tensors_of(module) if t_name not in own and bool(nan_mask(t).any())]
                if bad:
                    result.tainted[name] = sorted(bad)
    return result
