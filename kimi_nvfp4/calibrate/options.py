"""`CalibrateOptions`: calibrate's options, read by `kimi-nvfp4 calibrate`, `[calibrate]` in pipeline.toml and
`calibrate_checkpoint` (see kimi_nvfp4/stage_options.py for how one field becomes all three)."""

from __future__ import annotations

from enum import Enum
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, Field, ValidationInfo, field_validator

from ..stage_kit.memory_plan import GpuMemory, gpu_memory_field, max_chunk_tokens_field, states_device_field
from ..stage_kit.resume import resume_every_field, resume_max_overhead_field
from ..stage_kit.device_type import Device, OptionalDevice
from ..stage_options import Cli, StageOptions
from ..numerics.methods import ScaleMethod, StatisticsNeed, method_spec
from ..stage_kit.method_option import MethodOptions, checked_method_options, method_options_field, typed_method_options
from .expert_stats import ExpertStatsMode
from .policy import DEFAULT_EXPERT_POLICY, DEFAULT_MIN_EXPERT_TOKENS, ExpertPolicy

DEFAULT_SAMPLES = 512
DEFAULT_SEQ_LEN = 2048
# The shortest sequence that has a next token to predict.
MIN_SEQ_LEN = 2
_DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16"}
# The methods calibrate can run itself (calibrate/fused_method.py): those whose statistics come from the observe
# pass (W4A16 inputs); the W4A4-moment methods need the advance pass of the layer they would change.
FUSED_METHODS = tuple(m.value for m in ScaleMethod
                      if method_spec(m).statistics in (StatisticsNeed.DIAGONAL, StatisticsNeed.HESSIAN))
FusedMethod = Enum("FusedMethod", {n.upper().replace("-", "_"): n for n in FUSED_METHODS}, type=str)
FusedMethod.__doc__ = "Output-aware methods calibrate can solve in its layer loop ('act-diag', 'gptq')."


class Propagation(str, Enum):
    """With --method: which layer feeds the next one in calibrate's loop (docs/numerics.md, 'GPTQ inside
    calibrate')."""

    INT4 = "int4"  # the layer as convert wrote it (int4-aware weights)
    SEQUENTIAL = "sequential"  # the requantized layer (sequential GPTQ: the GPTQ paper, llm-compressor)


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
    method: FusedMethod | None = Field(
        None, description="Also requantize the routed experts with this output-aware method inside the layer loop: "
                          "each MoE layer's expert statistics are kept in memory, solved as soon as the layer's "
                          "observe pass ends, and the layer's expert tensors rewritten (no statistics on disk; "
                          "docs/requantize.md, 'Fused into calibrate').")
    method_options: MethodOptions = method_options_field(FUSED_METHODS)
    keep_expert_stats: bool = Field(False, description="With --method: also write the statistics files "
                                                       "(OUTPUT/calibration/expert_stats/), for debugging.")
    propagation: Propagation = Field(
        Propagation.INT4, description="With --method: what feeds the next layer. int4: the layer as convert wrote "
                                      "it (int4-aware weights; the shards byte-identical to --expert-stats hessian "
                                      "+ requantize --no-recalibrate); sequential: the requantized layer (as the "
                                      "GPTQ paper and llm-compressor), so later layers' statistics and input scales "
                                      "see the final model's inputs (docs/numerics.md, 'GPTQ inside calibrate').")

    # What decides the scales (with the data spec): `dtype` is left out, the manifest records the resolved one.
    RECORDED: ClassVar[tuple[str, ...]] = ("samples", "seq_len", "seed", "min_expert_tokens", "policy")

    @field_validator("dtype", mode="before")
    @classmethod
    def _dtype_name(cls, value: Any) -> Any:
        """torch.float32 / "fp32" / "Float32" -> "float32"."""
        name = str(value).removeprefix("torch.").lower()
        return _DTYPE_ALIASES.get(name, name)

    @field_validator("method_options")
    @classmethod
    def _typed_method_options(cls, value: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        method = info.data.get("method")
        if method is None:
            if value:
                raise ValueError("--method-option needs --method")
            return value
        return checked_method_options(method.value, value)

    @field_validator("propagation")
    @classmethod
    def _propagation_needs_method(cls, value: Propagation, info: ValidationInfo) -> Propagation:
        if value is not Propagation.INT4 and info.data.get("method") is None:
            raise ValueError("--propagation sequential needs --method")
        return value

    def method_config(self) -> BaseModel | None:
        """The fused method's whole typed options (`method_options` over its defaults), None without a method."""
        return None if self.method is None else typed_method_options(self.method.value, self.method_options)

    def recorded(self) -> dict[str, Any]:
        return {**self.model_dump(mode="json", include=set(self.RECORDED)), **self.recorded_expert_stats(),
                **self.recorded_method()}

    def recorded_method(self) -> dict[str, Any]:
        """`method` and its whole options where a method is fused in: absent otherwise, so records written before
        the option existed still match; likewise `propagation`, recorded only where it is not the default (int4)."""
        if self.method is None:
            return {}
        return {"method": self.method.value, "method_options": self.method_config().model_dump(mode="json"),
                **({} if self.propagation is Propagation.INT4 else {"propagation": self.propagation.value})}

    def recorded_expert_stats(self) -> dict[str, Any]:
        """`expert_stats` where it is on: absent at `none`, so records written before it existed still match."""
        return {} if self.expert_stats is ExpertStatsMode.NONE else {"expert_stats": self.expert_stats.value}
