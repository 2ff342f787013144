"""SGLang serving profiles: the documented flag sets `serve-check --profile` launches.

Each profile is SPEC §5's recipe for one machine shape. Flags mirror `python -m sglang.launch_server`
(sglang/srt/server_args.py); `build_launch_command` merges user overrides flag by flag, so
`--extra "--kv-cache-dtype auto"` replaces the profile's value instead of passing the flag twice.
"""

from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..errors import KimiNvfp4Error

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 30000  # SGLang's default --port
NAIVE_SUFFIX = "-naive"

# Flags shared by every NVFP4 profile. Why each one:
#   --quantization modelopt_fp4   read hf_quant_config.json / quantization_config as ModelOpt NVFP4
#                                 (srt/layers/quantization/modelopt_quant.py ModelOptFp4Config)
#   --kv-cache-dtype fp8_e4m3     the checkpoint declares kv_cache_quant_algo FP8 (calibrate's k/v scales, >= 1)
#   --trust-remote-code           SGLang loads Kimi's tokenizer through tokenization_kimi.py; this runs
#                                 the checkpoint's tokenizer code inside the SGLang process, never in ours
#   --tool-call-parser kimi_k2    srt/function_call/kimik2_detector.py -> OpenAI tool_calls
#   --reasoning-parser kimi_k2    <think>...</think> -> reasoning_content
#   --enable-cache-report         usage.prompt_tokens_details.cached_tokens (our cache-hit figure)
#   --enable-metrics              Prometheus /metrics for the operator
# The radix (prefix) cache stays ON: it is what makes 100k-token agent turns affordable (SPEC §5).
COMMON_FLAGS: tuple[str, ...] = (
    "--quantization", "modelopt_fp4",
    "--kv-cache-dtype", "fp8_e4m3",
    "--trust-remote-code",
    "--tool-call-parser", "kimi_k2",
    "--reasoning-parser", "kimi_k2",
    "--enable-cache-report",
    "--enable-metrics",
)

# Blackwell: W4A4 experts through FlashInfer's TRT-LLM MoE kernels, TRT-LLM MLA attention.
BLACKWELL_FLAGS: tuple[str, ...] = (
    "--moe-runner-backend", "flashinfer_trtllm",
    "--attention-backend", "trtllm_mla",
)
# Hopper has no FP4 tensor cores: SGLang runs modelopt_fp4 experts as Marlin W4A16 (sglang PR #25655,
# `--moe-runner-backend marlin`); activations stay BF16, so input_scale is unused there.
HOPPER_FLAGS: tuple[str, ...] = ("--moe-runner-backend", "marlin")

# What the naive comparison turns off (the seed's "naive" curve): no prefix reuse, BF16 KV cache.
NAIVE_FLAGS: tuple[str, ...] = ("--disable-radix-cache", "--kv-cache-dtype", "auto")


class ProfileError(KimiNvfp4Error):
    """Unknown profile name or malformed extra arguments."""


@dataclass(frozen=True)
class GpuRequirement:
    """What a profile needs from `nvidia-smi`: how many GPUs, which architectures, how much memory each."""

    count: int
    compute_caps: tuple[str, ...]  # as nvidia-smi prints them, e.g. "10.0"
    min_memory_gib: float  # per GPU, from memory.total
    architecture: str  # for messages


@dataclass(frozen=True)
class ServeProfile:
    name: str
    description: str
    tp: int
    flags: tuple[str, ...]
    gpus: GpuRequirement
    activations: str = "w4a4"  # what the reference emulator must emulate to agree with this profile
    notes: str = ""
    extra_flags: tuple[str, ...] = field(default=())

    def with_extra(self, extra: tuple[str, ...], suffix: str = "") -> ServeProfile:
        return replace(self, name=self.name + suffix, extra_flags=self.extra_flags + extra)


# B200: 180 GiB usable HBM3e each (nvidia-smi reports ~179 GiB); B300: 288 GB HBM3e (~268 GiB).
_B200 = ("10.0", "10.3")  # SM100 kernels also run on SM103
_B300 = ("10.3",)
_H200 = ("9.0",)

PROFILES: dict[str, ServeProfile] = {
    p.name: p
    for p in (
        ServeProfile("b200-tp4", "4x B200, TP4, NVFP4 W4A4 experts (Modal's replica shape)", 4,
                     COMMON_FLAGS + BLACKWELL_FLAGS, GpuRequirement(4, _B200, 170.0, "Blackwell (SM100)")),
        ServeProfile("b200-tp8", "8x B200, TP8, NVFP4 W4A4 experts (more KV cache per replica)", 8,
                     COMMON_FLAGS + BLACKWELL_FLAGS, GpuRequirement(8, _B200, 170.0, "Blackwell (SM100)")),
        ServeProfile("b300-tp4", "4x B300, TP4, NVFP4 W4A4 experts", 4,
                     COMMON_FLAGS + BLACKWELL_FLAGS, GpuRequirement(4, _B300, 250.0, "Blackwell Ultra (SM103)")),
        ServeProfile("b300-tp8", "8x B300, TP8, NVFP4 W4A4 experts", 8,
                     COMMON_FLAGS + BLACKWELL_FLAGS, GpuRequirement(8, _B300, 250.0, "Blackwell Ultra (SM103)")),
        ServeProfile("h200", "8x H200, TP8, NVFP4 weights through Marlin W4A16 (no FP4 tensor cores)", 8,
                     COMMON_FLAGS + HOPPER_FLAGS, GpuRequirement(8, _H200, 130.0, "Hopper (SM90)"),
                     activations="w4a16",
                     notes="attention backend left to SGLang's Hopper default (fa3 for MLA)"),
    )
}


def get_profile(name: str) -> ServeProfile:
    """`b200-tp4`, ... ; a `-naive` suffix adds NAIVE_FLAGS (radix cache off, BF16 KV) for --compare."""
    if name.endswith(NAIVE_SUFFIX) and name[: -len(NAIVE_SUFFIX)] in PROFILES:
        return PROFILES[name[: -len(NAIVE_SUFFIX)]].with_extra(NAIVE_FLAGS, NAIVE_SUFFIX)
    if name not in PROFILES:
        known = ", ".join(sorted(PROFILES)) + f" (each also with {NAIVE_SUFFIX})"
        raise ProfileError(f"unknown serving profile {name!r}; expected one of {known}")
    return PROFILES[name]


def _split_flags(args: tuple[str, ...] | list[str]) -> list[tuple[str, list[str]]]:
    """Group an argv tail into (flag, values) pairs; SGLang flags all start with `--`."""
    groups: list[tuple[str, list[str]]] = []
    for a in args:
        if a.startswith("--"):
            flag, eq, value = a.partition("=")
            groups.append((flag, [value] if eq else []))
        elif not groups:
            raise ProfileError(f"extra SGLang argument {a!r} does not follow a --flag")
        else:
            groups[-1][1].append(a)
    return groups


def merge_flags(base: tuple[str, ...] | list[str], overrides: tuple[str, ...] | list[str]) -> list[str]:
    """Base flags with every flag in `overrides` replacing the same flag's value (or appended if new)."""
    merged = dict(_split_flags(base))  # dicts keep insertion order: the command reads like the profile
    for flag, values in _split_flags(overrides):
        merged[flag] = values
    out: list[str] = []
    for flag, values in merged.items():
        out.append(flag)
        out.extend(values)
    return out


def parse_extra_args(text: str | None) -> tuple[str, ...]:
    return tuple(shlex.split(text)) if text else ()


def build_launch_command(
    profile: ServeProfile,
    model_path: str | Path,
    *,
    host: str = DEFAULT_HOST,
    port: int = DEFAULT_PORT,
    extra_args: tuple[str, ...] = (),
    python: str = sys.executable,
) -> list[str]:
    """The `python -m sglang.launch_server ...` argv for `profile` on `model_path`."""
    base = ["--model-path", str(model_path), "--host", host, "--port", str(port), "--tp", str(profile.tp)]
    flags = merge_flags(base + list(profile.flags), list(profile.extra_flags) + list(extra_args))
    return [python, "-m", "sglang.launch_server", *flags]
