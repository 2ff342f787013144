"""The memory planner of the model stages (calibrate, validate): where things live, sized before the first layer.

A model stage holds, besides one decoder layer at a time, every sequence's hidden state for each stream it steps
(calibrate: one; validate: INT4, one per NVFP4 mode, and the amax baseline), plus one more while a layer runs (the
post-attention residual). Validate's estimate is the largest of three moments of a MoE layer, each counted from what
validate/streams.py keeps alive then (memory_estimate.py `estimate`): the INT4 stream's MoE chunks, the amax
baseline's conversion, and the logits after the last layer. At Kimi K2.6's defaults (512 x 2048 tokens, hidden 7168,
bf16) a stream is 14 GiB, a layer's routed experts 8.9 GiB as stored and 31.5 GiB decoded, a 65,536-token MoE chunk
~41 GiB of working memory by the shared count (~22 GiB as validate's INT4 stream holds it). What fits depends on the
GPU and on the other jobs sharing it, so nothing here is a constant: the plan is made from the memory the stage may
use (the GPU's free memory or a `--gpu-memory` cap; the host's available RAM) and from the checkpoint's config, and
it decides, in this order of what gives way first:
1. whether each layer is dequantized once (`materialize`, a speed win: without it every expert is dequantized once
   per chunk);
2. whether the next layer is read while this one computes (`prefetch`);
3. the MLP/MoE chunk size (halved down to MIN_CHUNK_TOKENS);
4. where the hidden states live: the GPU, or pinned host memory (copied per sequence, on the copy stream).
An explicit setting (`--max-chunk-tokens`, `--states-device`) is kept; if it cannot fit, the plan is refused
before any weight is read, with the setting that would fit (`ResourceError`, exit 10).

The estimate is a sum of named components (`MemoryPlan.components`, memory_estimate.py), each from the config and
the ops that hold it; bench/profile/memory_plan.py compares it with the measured peak on the H200
(docs/benchmarks.md).
"""

from __future__ import annotations

import os
import re
from typing import Annotated

import click
import torch
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from ..checkpoint.k2_config import K2Config
from ..errors import ResourceError
from ..stage_options import Cli
from .memory_estimate import GIB, Stage, estimate

# Fraction of the GPU's memory a plan may use: allocator block rounding makes the peak reserved memory exceed the
# peak allocated by a few percent.
GPU_USABLE_FRACTION = 0.94
MIN_CHUNK_TOKENS = 4096
# States stay on the GPU only with chunks of at least 1/4 of the default: smaller chunks dequantize every expert
# that many more times per layer, which costs more than copying the states over PCIe.
DEVICE_STATES_MIN_CHUNK_FRACTION = 4
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(i?)b?\s*$", re.IGNORECASE)


def parse_bytes(text: str | int | float) -> int:
    """`80GiB`, `80G`, `48 GB`, `1.5TiB` or a number of bytes -> bytes (GB = 10^9, GiB = 2^30; a bare `G` is GiB)."""
    if isinstance(text, (int, float)):
        return int(text)
    m = _SIZE.match(str(text))
    if not m:
        raise ValueError(f"{text!r} is not a size (e.g. 80GiB, 48GB, 137438953472)")
    value, unit, binary = float(m.group(1)), m.group(2).lower(), m.group(3)
    power = " kmgt".index(unit) if unit else 0
    decimal = str(text).strip().lower().endswith(f"{unit}b") and not binary
    return int(value * (1000 if decimal else 1024) ** power)


def format_bytes(n: int) -> str:
    return f"{n / GIB:.1f} GiB"


class MemoryPlan(BaseModel):
    """Where a model stage keeps what, and what that is estimated to cost (recorded in the stage's report)."""

    model_config = ConfigDict(extra="forbid")

    stage: str
    device: str
    dtype: str
    tokens: int  # this rank's tokens
    seq_len: int
    streams: int
    states_device: str
    chunk_tokens: int
    materialize: bool
    prefetch: bool
    gpu_budget_bytes: int | None
    host_budget_bytes: int
    estimated_peak_gpu_bytes: int | None
    estimated_peak_host_bytes: int
    components: dict[str, int]
    # one resume snapshot on disk: every stream's hidden states (stage_kit/disk_space.py)
    snapshot_bytes: int = 0

    @property
    def states_on_host(self) -> bool:
        return self.device.startswith("cuda") and self.states_device == "cpu"

    def summary(self) -> str:
        gpu = "" if self.estimated_peak_gpu_bytes is None else (
            f", GPU peak ~{format_bytes(self.estimated_peak_gpu_bytes)} of {format_bytes(self.gpu_budget_bytes)}")
        return (f"memory plan ({self.stage}): {self.streams} stream(s) x {self.tokens:,} tokens on "
                f"{'host (pinned)' if self.states_on_host else self.states_device}, chunks of {self.chunk_tokens:,} "
                f"tokens, layers {'dequantized once' if self.materialize else 'dequantized per chunk'}"
                f"{', next layer prefetched' if self.prefetch else ''}{gpu}, host peak "
                f"~{format_bytes(self.estimated_peak_host_bytes)} of {format_bytes(self.host_budget_bytes)}")


def gpu_budget(device: torch.device, cap: int | None) -> int:
    """Bytes the stage may use on `device`: `cap` (a shared GPU, a test, or planning for another GPU), else what
    is free now plus what this process's allocator holds unused, times GPU_USABLE_FRACTION."""
    if cap is not None:
        return cap
    if not torch.cuda.is_available():
        raise ResourceError(f"planning for {device} needs --gpu-memory (torch sees no CUDA device here)")
    free, _total = torch.cuda.mem_get_info(device)
    free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return int(free * GPU_USABLE_FRACTION)


def host_budget(cap: int | None) -> int:
    if cap is not None:
        return cap
    import psutil

    return int(psutil.virtual_memory().available)


def plan_memory(cfg: K2Config, *, stage: Stage, device: torch.device, dtype: torch.dtype, tokens: int, seq_len: int,
                streams: int, sources: int, gpu_memory: int | None = None, host_memory: int | None = None,
                chunk_tokens: int | None = None, states_device: str | None = None, default_chunk_tokens: int,
                baseline: bool = False, reserve_bytes: int = 0) -> MemoryPlan:
    """The plan for a model stage over `tokens` tokens (this rank's) in `streams` hidden-state streams, reading
    `sources` checkpoints per layer. `chunk_tokens` / `states_device`: the user's explicit settings (kept, or
    refused with what would fit). `reserve_bytes`: left free on the compute device (GPU, else host) for what the
    stage adds beside its layer loop (calibrate --method's statistics, stage_kit/expert_solve_plan.py).
    Raises ResourceError when nothing fits."""
    on_gpu = device.type == "cuda"
    gpu_cap = gpu_budget(device, gpu_memory) if on_gpu else None
    host_cap = host_budget(host_memory)
    gpu_fit = None if gpu_cap is None else gpu_cap - reserve_bytes
    host_fit = host_cap - (0 if on_gpu else reserve_bytes)
    tried = []
    for on_device, chunk, prefetch, materialize in _candidates(device, sources, chunk_tokens, states_device,
                                                                default_chunk_tokens):
        gpu, host, comp = estimate(cfg, stage=stage, device=device, dtype=dtype, tokens=tokens, seq_len=seq_len,
                                   streams=streams, sources=sources, states_on_device=on_device, chunk_tokens=chunk,
                                   materialize=materialize, prefetch=prefetch, baseline=baseline)
        tried.append((on_device, chunk, gpu, host))
        if host <= host_fit and (gpu is None or gpu <= gpu_fit):
            return MemoryPlan(
                stage=stage, device=str(device), dtype=str(dtype).removeprefix("torch."), tokens=tokens,
                seq_len=seq_len, streams=streams, states_device=str(device) if on_device else "cpu",
                chunk_tokens=chunk, materialize=materialize, prefetch=prefetch,
                gpu_budget_bytes=gpu_cap, host_budget_bytes=host_cap, estimated_peak_gpu_bytes=gpu,
                estimated_peak_host_bytes=host, components=comp,
                snapshot_bytes=streams * tokens * cfg.hidden_size * torch.empty((), dtype=dtype).element_size())
    raise ResourceError(_refusal(stage, device, tokens, streams, gpu_cap, host_cap, tried, chunk_tokens,
                                 states_device, cfg, dtype, seq_len, sources, gpu_memory, host_memory,
                                 default_chunk_tokens, baseline))


def _candidates(device: torch.device, sources: int, chunk_tokens: int | None, states_device: str | None,
                default_chunk_tokens: int):
    """Configurations in order of preference (see the module docstring): states on the device with chunks down to
    a quarter of the default, then states on the host with every chunk size; within each, prefetch and every
    source dequantized once first, giving way one source at a time."""
    if device.type != "cuda":
        for chunk in [chunk_tokens] if chunk_tokens else _halvings(default_chunk_tokens):
            yield True, chunk, False, False
        return
    explicit_states = None if states_device is None else torch.device(states_device).type == device.type
    placements = [explicit_states] if explicit_states is not None else [True, False]
    for on_device in placements:
        chunks = [chunk_tokens] if chunk_tokens else _halvings(default_chunk_tokens)
        if on_device and not chunk_tokens and explicit_states is None:
            # below a quarter of the default, dequantizing every expert per chunk costs more than host states
            chunks = [c for c in chunks if c * DEVICE_STATES_MIN_CHUNK_FRACTION >= default_chunk_tokens] or chunks[:1]
        for chunk in chunks:
            for materialize in (True, False):
                for prefetch in (True, False):
                    yield on_device, chunk, prefetch, materialize


def _halvings(start: int) -> list[int]:
    out, c = [], start
    while c >= MIN_CHUNK_TOKENS:
        out.append(c)
        c //= 2
    return out or [start]


def _refusal(stage, device, tokens, streams, gpu_cap, host_cap, tried, chunk_tokens, states_device, cfg, dtype,
             seq_len, sources, gpu_memory, host_memory, default_chunk_tokens, baseline) -> str:
    smallest = min(tried, key=lambda t: (t[2] or 0) + t[3])
    need = (f"at least ~{format_bytes(smallest[2])} of GPU memory (budget {format_bytes(gpu_cap)}) and "
            if smallest[2] is not None else "") + f"~{format_bytes(smallest[3])} of host memory " \
                                                  f"(budget {format_bytes(host_cap)})"
    advice = []
    if chunk_tokens is not None or states_device is not None:
        try:
            fallback = plan_memory(cfg, stage=stage, device=device, dtype=dtype, tokens=tokens, seq_len=seq_len,
                                   streams=streams, sources=sources, gpu_memory=gpu_memory, host_memory=host_memory,
                                   default_chunk_tokens=default_chunk_tokens, baseline=baseline)
            advice.append(f"without the explicit setting it fits: --max-chunk-tokens {fallback.chunk_tokens} "
                          f"--states-device {fallback.states_device}")
        except ResourceError:
            pass
    if not advice and baseline:
        # the amax baseline's stream: one more stream and its own routed experts
        try:
            plan_memory(cfg, stage=stage, device=device, dtype=dtype, tokens=tokens, seq_len=seq_len,
                        streams=streams - 1, sources=sources, gpu_memory=gpu_memory, host_memory=host_memory,
                        chunk_tokens=chunk_tokens, states_device=states_device,
                        default_chunk_tokens=default_chunk_tokens)
            advice.append("without the amax baseline it fits: --baseline off (it is one more stream and its own "
                          "routed experts)")
        except ResourceError:
            pass
    if not advice:
        advice.append("use fewer --samples or a shorter --seq-len, run on more GPUs (torchrun: each rank holds its "
                      "share of the sequences), or free memory on the host")
    return (f"{stage}: {streams} stream(s) of {tokens:,} tokens on {device} do not fit: the smallest plan needs "
            f"{need}; {'; '.join(advice)}")


# --- what the stages share -------------------------------------------------------------------------------------

def parse_size_option(value):
    """A `gpu_memory` value from the CLI, pipeline.toml or the API: a size string, a number of bytes or None."""
    return None if value is None or value == "" else parse_bytes(value)


# The options every model stage's memory plan reads, declared once (calibrate/options.py, validate/options.py).
GpuMemory = Annotated[int | None, Cli(click_type=click.STRING, metavar="SIZE"), BeforeValidator(parse_size_option)]


def gpu_memory_field():
    """`gpu_memory`: a size such as 80GiB, stored in bytes."""
    return Field(None, ge=1, description="GPU memory this stage may use, e.g. 80GiB (default: what is free when it "
                                         "starts). Also caps the process's allocations: for a shared GPU, and for "
                                         "planning another GPU with --dry-run.")


def max_chunk_tokens_field():
    return Field(None, ge=1, description="Tokens per MLP/MoE chunk (default: the memory plan decides; results do not "
                                         "depend on it).")


def states_device_field():
    return Field(None, description="Keep hidden states here (e.g. cpu) when they do not fit the GPU (default: the "
                                   "memory plan decides).")


def apply_gpu_cap(device: torch.device, cap: int | None) -> None:
    """Prepare the CUDA allocator for the plan: expandable segments, and `cap` bytes at most on `device` (the
    caching allocator refuses beyond it), so that what the plan promised is also what the process may take on a
    shared GPU.

    Expandable segments because the plan counts the bytes the stage allocates, and with the default allocator
    the K2.6 validate at 512 x 2048 ran out of memory with 30 GiB reserved but unallocated in blocks of the wrong
    size (bench/results/memory_plan_h200.json): a stream of 14 GiB tensors freed and allocated in other sizes
    fragments fixed segments. A user's own PYTORCH_CUDA_ALLOC_CONF is left as it is."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return
    if "PYTORCH_CUDA_ALLOC_CONF" not in os.environ and "PYTORCH_ALLOC_CONF" not in os.environ:
        # torch >= 2.10 names it per accelerator; the CUDA spelling is deprecated there
        setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None) or torch.cuda.memory._set_allocator_settings
        setter("expandable_segments:True")
    if cap is None:
        return
    index = torch.cuda.current_device() if device.index is None else device.index  # the API takes an index
    total = torch.cuda.get_device_properties(index).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), index)


def out_of_memory(plan: MemoryPlan, error: BaseException) -> ResourceError:
    """The named error for a CUDA out-of-memory that happened despite the plan (another process took memory, or
    the estimate was short): the plan, and what to change."""
    return ResourceError(
        f"{plan.stage} ran out of GPU memory despite its plan ({plan.summary()}): {str(error).splitlines()[0]} -- "
        f"another process may be using the GPU; give the stage less with --gpu-memory (e.g. "
        f"{max(1, int(plan.gpu_budget_bytes * 0.8 / GIB)) if plan.gpu_budget_bytes else 40}GiB), or keep the hidden "
        f"states on the host with --states-device cpu")


def announce(plan: MemoryPlan, enabled: bool) -> None:
    """The plan's one line on stderr (and nothing when progress output is off)."""
    if enabled:
        import sys

        print(plan.summary(), file=sys.stderr, flush=True)


def default_chunk_tokens(device: torch.device) -> int:
    from ..model.runner import CUDA_MAX_CHUNK_TOKENS, DEFAULT_MAX_CHUNK_TOKENS

    return CUDA_MAX_CHUNK_TOKENS if device.type == "cuda" else DEFAULT_MAX_CHUNK_TOKENS


def plan_stage(cfg: K2Config, opts, *, stage: Stage, device: torch.device, dtype: torch.dtype, tokens: int,
               streams: int, sources: int, baseline: bool = False, reserve_bytes: int = 0) -> MemoryPlan:
    """The plan for a stage's options model (`gpu_memory`, `max_chunk_tokens`, `states_device`, `seq_len`)."""
    return plan_memory(cfg, stage=stage, device=device, dtype=dtype, tokens=tokens, seq_len=opts.seq_len,
                       streams=streams, sources=sources, gpu_memory=opts.gpu_memory,
                       chunk_tokens=opts.max_chunk_tokens, states_device=opts.states_device,
                       default_chunk_tokens=default_chunk_tokens(device), baseline=baseline,
                       reserve_bytes=reserve_bytes)


def planning_device(name: str) -> torch.device:
    """The device a `--dry-run` plans for, which need not be present here (`--device cuda --gpu-memory 80GiB` on
    a laptop); `auto` is what this machine has."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def rank_tokens(total: int) -> int:
    """This rank's share of `total` tokens under torchrun (WORLD_SIZE), rounded up: what a dry run plans for."""
    import os

    world = max(1, int(os.environ.get("WORLD_SIZE", "1")))
    return -(-total // world)
