"""`CalibrateOptions`: calibrate's options, read by `kimi-nvfp4 calibrate`, `[calibrate]` in pipeline.toml and
`calibrate_checkpoint` (see kimi_nvfp4/stage_options.py for how one field becomes all three)."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, field_validator

from ..stage_kit.memory_plan import GpuMemory, gpu_memory_field, max_chunk_tokens_field, states_device_field
from ..stage_kit.resume import resume_every_field, resume_max_overhead_field
from ..stage_kit.device_type import Device, OptionalDevice
from ..stage_options import Cli, StageOptions
from .expert_stats import ExpertStatsMode
from .policy import DEFAULT_EXPERT_POLICY, DEFAULT_MIN_EXPERT_TOKENS, ExpertPolicy

DEFAULT_SAMPLES = 512
DEFAULT_SEQ_LEN = 2048
# The shortest sequence that has a next token to predict.
MIN_SEQ_LEN = 2
_DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16"}


class CalibrateOptions(StageOptions):
    samples: int = Field(DEFAULT_SAMPLES, ge=1, description="Number of token sequences.")
    seq_len: int = Field(DEFAULT_SEQ_LEN, ge=MIN_SEQ_LEN,
                         description="Tokens per sequence; longer sessions are split or truncated.")
    seed: int = Field(0, description="Seed for picking sequences.")
    min_expert_tokens: int = Field(DEFAULT_MIN_EXPERT_TOKENS, ge=0,
                                   description="Experts with fewer routed tokens get the --expert-policy.")
    policy: Annotated[ExpertPolicy, Cli("--expert-policy")] = Field(
        DEFAULT_EXPERT_POLICY, description="peer-max: the layer's max over covered experts; route-all: every token "
                                           "through every expert for statistics only.")
    generated_sessions: Annotated[int | None, Cli("--sessions")] = Field(
        None, ge=1, description="Sessions to generate for builtin/tree: data (default: enough for --samples; "
                                "~0.3 s each).")
    device: Device = Field("auto", description="auto, cpu, cuda or cuda:N.")
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="Compute dtype of the reference model. auto: bfloat16 on CUDA (what SGLang serves: bf16 "
                            "hidden states and matmuls), float32 on CPU.")
    max_chunk_tokens: int | None = max_chunk_tokens_field()
    states_device: OptionalDevice = states_device_field()
    gpu_memory: GpuMemory = gpu_memory_field()
    resume_every: int = resume_every_field("OUTPUT")
    resume_max_overhead: float = resume_max_overhead_field()
    expert_stats: ExpertStatsMode = Field(
        ExpertStatsMode.NONE, description="Also record each routed expert's input statistics for `requantize` "
                                          "(OUTPUT/calibration/expert_stats/): diag = channel energies (act-diag), "
                                          "hessian = also the dense X^T X where an expert saw enough tokens (gptq); "
                                          "w4a4 = the served inputs' E[x x^T], E[x~ x~^T], E[x x~^T] with x~ the "
                                          "NVFP4-quantized input, from the W4A4 pass (gptq-w4a4, gptq-w4a4-diag).")

    # What decides the scales (with the data spec): `dtype` is left out, the manifest records the resolved one.
    RECORDED: ClassVar[tuple[str, ...]] = ("samples", "seq_len", "seed", "min_expert_tokens", "policy")

    @field_validator("dtype", mode="before")
    @classmethod
    def _dtype_name(cls, value: Any) -> Any:
        """torch.float32 / "fp32" / "Float32" -> "float32"."""
        name = str(value).removeprefix("torch.").lower()
        return _DTYPE_ALIASES.get(name, name)

    def recorded(self) -> dict[str, Any]:
        return {**self.model_dump(mode="json", include=set(self.RECORDED)), **self.recorded_expert_stats()}

    def recorded_expert_stats(self) -> dict[str, Any]:
        """`expert_stats` where it is on: absent at `none`, so records written before it existed still match."""
        return {} if self.expert_stats is ExpertStatsMode.NONE else {"expert_stats": self.expert_stats.value}
