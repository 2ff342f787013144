"""SGLang's process state on a CPU-only machine, set up the way its scheduler process sets it up (SPEC §7).

The model-executing process of an SGLang server publishes its `ServerArgs` through
`sglang.srt.runtime_context`, joins the tensor-parallel groups and seeds the MoE flags before it
builds the model (managers/scheduler.py, weight_cache/daemon.py). We do the same with one process:
ServerArgs resolved as on a B200 (the platform reported as SM100 through SGLang's own
`runtime_context.override_platform`), a one-process gloo group, `initialize_moe_config()`.
What a CPU forces on top (each logged as a CpuPatch): torchvision (see torchvision_standin.py) and
`current_platform.get_device()`, which SGLang's rotary embeddings call for their cos/sin cache and
which the base platform (no CUDA, no CPU-engine opt-in) leaves unimplemented.
"""

from __future__ import annotations

import importlib.metadata
import socket
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import EngineUnavailableError
from .cpu_patches import PatchLog, ensure_torchvision

SGLANG_TESTED_VERSION = "0.5.23"
# What `override_platform` reports: a B200/B300 (SM100), where modelopt_fp4 runs W4A4 on flashinfer_trtllm.
BLACKWELL_FACTS: dict[str, Any] = {"is_blackwell": True, "is_sm100": True, "device_capability": (10, 0)}
# The README's serve command (docs/serve_check.md): TRT-LLM MLA attention, FP8 KV cache when declared.
ATTENTION_BACKEND = "trtllm_mla"
FP8_KV_CACHE_DTYPE = "fp8_e4m3"
# "for-scheme": SGLang's own choice on SM100 ("auto" -> flashinfer_trtllm) for a W4A4 checkpoint, and Marlin for
# a weight-only one: TRT-LLM's NVFP4 MoE is W4A4 only and SGLang 0.5.23 does not switch it for a modelopt_fp4
# W4A16_NVFP4 checkpoint (it quantizes the activations with the input scales' fill value 1.0).
MOE_BACKEND_FOR_SCHEME = "for-scheme"
MOE_BACKENDS = (MOE_BACKEND_FOR_SCHEME, "auto", "flashinfer_trtllm", "flashinfer_cutlass", "marlin")
SERVED_DEVICE = "cuda"  # ServerArgs as on the B200; tensors are built on the CPU or meta device regardless
PUBLISH_ROLE = "scheduler"  # the model-executing process (runtime_context.ROLE_NAMESPACE_SETS)
_TP_SIZE = 1  # one process: per-rank shapes of TP > 1 are not built


@dataclass(frozen=True)
class SglangSettings:
    moe_runner_backend: str = "auto"  # SGLang's --moe-runner-backend ("auto": SGLang picks, on SM100 flashinfer_trtllm)
    kv_cache_fp8: bool = True

    @classmethod
    def for_checkpoint(cls, moe_runner_backend: str, weight_only: bool, kv_cache_fp8: bool) -> "SglangSettings":
        if moe_runner_backend == MOE_BACKEND_FOR_SCHEME:
            moe_runner_backend = "marlin" if weight_only else "auto"
        return cls(moe_runner_backend=moe_runner_backend, kv_cache_fp8=kv_cache_fp8)


@dataclass
class SglangSession:
    version: str
    server_args: Any
    model_config: Any
    log: PatchLog


def sglang_version() -> str:
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        raise EngineUnavailableError(
            "SGLang is not installed: `pip install 'kimi-nvfp4[engines]'` and then, without its dependencies, "
            "`pip install --no-deps -r kimi_nvfp4/engine_check/requirements-engines-cpu.txt` (docs/engine_check.md)"
        ) from None


def import_sglang(log: PatchLog) -> str:
    """Import SGLang's model-loading modules (installing the torchvision stand-in first if needed)."""
    version = sglang_version()
    ensure_torchvision(log)
    try:
        import sglang.srt.model_loader.loader  # noqa: F401
        import sglang.srt.models.kimi_k25  # noqa: F401
    except ImportError as e:
        raise EngineUnavailableError(f"SGLang {version} does not import on this machine: {e}") from e
    return version


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cpu_device(device_id: int = 0) -> torch.device:
    return torch.device("cpu")


@contextmanager
def sglang_on_cpu(model_path: str, settings: SglangSettings, log: PatchLog) -> Iterator[SglangSession]:
    """Process state for building and loading `model_path` with SGLang, restored (platform facts) on exit."""
    version = import_sglang(log)
    from sglang.srt import runtime_context as rc
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.distributed.parallel_state import (
        init_distributed_environment,
        initialize_model_parallel,
        model_parallel_is_initialized,
    )
    from sglang.srt.layers.moe import initialize_moe_config
    from sglang.srt.platforms import current_platform
    from sglang.srt.server_args import ServerArgs

    with ExitStack() as stack:
        stack.enter_context(rc.override_platform(**BLACKWELL_FACTS))
        log.record(
            "sglang.srt.runtime_context.override_platform(is_blackwell, is_sm100, device_capability=(10, 0))",
            "no GPU: SGLang would see no Blackwell and refuse NVFP4 W4A4 (modelopt_quant.py "
            "ModelOptNvFp4FusedMoEMethod.__init__) or pick other backends",
            "SGLang's own switch: ServerArgs, the quant config and the MoE method decide as on a B200",
        )
        stack.enter_context(
            log.attribute(
                current_platform, "get_device", _cpu_device,
                target="sglang.srt.platforms.current_platform.get_device -> torch.device('cpu')",
                why="the base platform SGLang falls back to without CUDA leaves get_device unimplemented; rotary "
                "embeddings call it for their cos/sin cache",
                effect="caches are built on the CPU; no parameter depends on it",
            )
        )
        server_args = ServerArgs(
            model_path=model_path,
            device=SERVED_DEVICE,
            tp_size=_TP_SIZE,
            trust_remote_code=False,  # never run code shipped in a checkpoint
            moe_runner_backend=settings.moe_runner_backend,
            attention_backend=ATTENTION_BACKEND,
            kv_cache_dtype=FP8_KV_CACHE_DTYPE if settings.kv_cache_fp8 else "auto",
        )
        rc.publish(server_args, role=PUBLISH_ROLE, ranks=rc.SpawnRanks(world_rank=0))
        log.record(
            "torch.distributed: a one-process gloo group (init_distributed_environment, initialize_model_parallel)",
            "NCCL needs GPUs; SGLang's parallel layers need their groups to exist",
            "tensor parallel size 1: every parameter is built whole (per-rank TP shapes are not checked)",
        )
        if not torch.distributed.is_initialized():
            init_distributed_environment(
                world_size=1, rank=0, local_rank=0, backend="gloo",
                distributed_init_method=f"tcp://127.0.0.1:{_free_port()}",
            )
        if not model_parallel_is_initialized():
            initialize_model_parallel()
        initialize_moe_config()
        model_config = ModelConfig.from_server_args(server_args)
        yield SglangSession(version, server_args, model_config, log)
