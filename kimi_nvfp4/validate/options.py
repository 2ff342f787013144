"""`ValidateOptions`: validate's options, read by `kimi-nvfp4 validate`, `[validate]` in pipeline.toml and
`validate_checkpoint` (see kimi_nvfp4/stage_options.py for how one field becomes all three)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

import click
from pydantic import Field, field_validator

from ..calibrate.options import CalibrateOptions
from ..model.linear import ActivationMode
from ..model.nvfp4_linears import InputScaleReduction
from ..stage_kit.memory_plan import GpuMemory, gpu_memory_field, max_chunk_tokens_field, states_device_field
from ..stage_kit.resume import resume_every_field, resume_max_overhead_field
from ..stage_kit.device_type import Device, OptionalDevice
from ..stage_options import Cli, StageOptions
from .experts import DEFAULT_EXPERT_CHECK_TOKENS
from .gates import GateThresholds, load_gates

DEFAULT_VALIDATE_SAMPLES = 512
DEFAULT_VALIDATE_SEQ_LEN = 2048
DEFAULT_MODES = (ActivationMode.W4A4.value, ActivationMode.W4A16.value)
# The shortest sequence that has a next token to predict.
MIN_SEQ_LEN = 2


class ValidateOptions(StageOptions):
    gates_file: Annotated[Path | None, Cli("--gates", click_type=click.Path(exists=True, dir_okay=False))] = Field(
        None, description="TOML or JSON file overriding some default thresholds.")
    gate_overrides: Annotated[list[str], Cli("--gate", metavar="KEY=VALUE")] = Field(
        default_factory=list,
        description="Override one threshold, e.g. --gate w4a4.kl_mean_max=0.02 (repeatable; wins over --gates). "
                    "Keys: weight_rel_mse_max, weight_rel_mse_mean_max, weight_exact_fraction_min, and per mode "
                    "(w4a4./w4a16.) kl_mean_max, kl_p99_max, top1_min, ppl_ratio_max, drift_max, "
                    "expert_output_rel_mse_max.")
    modes: Annotated[list[ActivationMode], Cli("--mode", show_default=False)] = Field(
        default_factory=lambda: [ActivationMode(m) for m in DEFAULT_MODES], min_length=1,
        description="Emulation modes to compare (default both): w4a4 = Blackwell kernels, w4a16 = Hopper Marlin.")
    input_scale_reduction: InputScaleReduction = Field(
        InputScaleReduction.LAYER_MAX,
        description="How SGLang combines expert input scales: layer_max (flashinfer backends) or per_expert "
                    "(cutlass).")
    samples: int = Field(DEFAULT_VALIDATE_SAMPLES, ge=1, description="Held-out sequences.")
    seq_len: int = Field(DEFAULT_VALIDATE_SEQ_LEN, ge=MIN_SEQ_LEN, description="Tokens per sequence.")
    seed: int = Field(0, description="Seed for picking sequences.")
    generated_sessions: Annotated[int | None, Cli("--sessions")] = Field(
        None, ge=1, description="Sessions to generate for builtin/tree: data (default: enough for --samples; "
                                "~0.3 s each).")
    device: Device = Field("auto", description="auto, cpu, cuda or cuda:N.")
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="Compute dtype of every stream. auto: bfloat16 on CUDA (what SGLang serves: bf16 hidden "
                            "states, matmuls and logits), float32 on CPU.")
    baseline: Literal["auto", "on", "off"] = Field(
        "auto", description="Also run the amax (Model Optimizer rule) conversion of the same experts as a W4A16 "
                            "stream and fail when the checkpoint is worse than it by more than the baseline_* gates "
                            "allow (one more stream: ~+30% time). auto: on when the held-out set has at least "
                            "16384 tokens (a ratio of two KLs over fewer tokens is noise).")
    expert_check_tokens: int = Field(
        DEFAULT_EXPERT_CHECK_TOKENS, ge=0,
        description="Tokens compared per routed expert and layer in the per-expert output check (the first the "
                    "router sends it; per rank under torchrun). 0: every routed token (two more MoE passes per "
                    "layer at K2.6 scale).")
    resume_every: int = resume_every_field("REPORT_DIR")
    resume_max_overhead: float = resume_max_overhead_field()
    max_chunk_tokens: int | None = max_chunk_tokens_field()
    states_device: OptionalDevice = states_device_field()
    gpu_memory: GpuMemory = gpu_memory_field()

    # What decides the verdict (with the data spec and the thresholds), as validate records it.
    RECORDED: ClassVar[tuple[str, ...]] = (
        "samples", "seq_len", "seed", "modes", "input_scale_reduction", "expert_check_tokens",
    )

    @field_validator("dtype", mode="before")
    @classmethod
    def _dtype_name(cls, value: Any) -> Any:
        """torch.bfloat16 / "bf16" -> "bfloat16" (calibrate's rule)."""
        return CalibrateOptions._dtype_name(value)

    @field_validator("baseline", mode="before")
    @classmethod
    def _baseline_flag(cls, value: Any) -> Any:
        return {True: "on", False: "off"}.get(value, value) if isinstance(value, bool) else value

    @field_validator("modes", mode="after")
    @classmethod
    def _each_mode_once(cls, modes: list[ActivationMode]) -> list[ActivationMode]:
        return list(dict.fromkeys(modes))

    @property
    def sets_thresholds(self) -> bool:
        """True when a gates file or an override changes the default thresholds."""
        return self.gates_file is not None or bool(self.gate_overrides)

    def thresholds(self) -> GateThresholds:
        """The default gates, then `gates_file`, then `gate_overrides` (validate/gates.py `load_gates`)."""
        return load_gates(self.gates_file, tuple(self.gate_overrides))

    def recorded(self) -> dict[str, Any]:
        return self.model_dump(mode="json", include=set(self.RECORDED))
