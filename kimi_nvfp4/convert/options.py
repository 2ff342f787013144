"""`ConvertOptions`: convert's options, read by `kimi-nvfp4 convert`, `[convert]` in pipeline.toml and
`convert_checkpoint` (see kimi_nvfp4/stage_options.py for how one field becomes all three)."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, Field, ValidationInfo, field_validator

from ..numerics.bf16_source import Bf16ScaleRule
from ..numerics.methods import DEFAULT_METHOD, ScaleMethod, weight_only_methods
from ..stage_kit.device_type import Device
from ..stage_kit.method_option import MethodOptions, checked_method_options, method_options_field, typed_method_options
from ..stage_options import Cli, StageOptions
from .shared_experts import SharedExperts

# "none": declare no KV-cache quantization (recorded as null in the manifest and left out of hf_quant_config).
KV_CACHE_CHOICES = ("FP8", "none")


class ConvertOptions(StageOptions):
    method: Annotated[ScaleMethod, Cli(choices=tuple(m.value for m in weight_only_methods()))] = Field(
        DEFAULT_METHOD, description="How NVFP4 scales are chosen for each INT4 expert matrix (the weight-only "
                                    "methods of the registry, docs/numerics.md).")
    method_options: MethodOptions = method_options_field(m.value for m in weight_only_methods())
    device: Device = Field(
        "auto", description="Where experts are quantized (auto, cpu, cuda or cuda:N); CPU and CUDA write identical "
                            "bytes.")
    workers: int = Field(1, ge=1, description="Shards converted in parallel (memory: about two shards per worker).")
    kv_cache_quant_algo: Annotated[Literal["FP8"] | None, Cli("--kv-cache", choices=KV_CACHE_CHOICES)] = Field(
        "FP8", description="KV-cache format declared in the quant config (NVIDIA ships K2.6 with FP8).")
    shared_experts: SharedExperts = Field(
        SharedExperts.BF16, description="The MoE layers' shared experts: bf16 (copied, as NVIDIA's K2.6 NVFP4) or "
                                        "nvfp4 (quantized from BF16, gate/up sharing one weight_scale_2; Modal's "
                                        "B200 recipe).")
    shared_expert_scales: Bf16ScaleRule = Field(
        Bf16ScaleRule.AMAX, description="Block scales of NVFP4 shared experts: amax (Model Optimizer's rule) or mse "
                                        "(least weight error near it; never worse). Ignored with --shared-experts "
                                        "bf16.")
    overwrite: bool = Field(False, description="Replace an earlier conversion made with other settings: removes what "
                                               "its manifest lists and keeps (and names) everything else.")
    overwrite_unlisted: bool = Field(False, description="With --overwrite: also remove the files and folders the "
                                                        "earlier conversion's manifest does not list (notes, results).")
    revision: str | None = Field(None, description="Hub revision when SOURCE is a repo id.")
    record_stats: Annotated[bool, Cli("--stats/--no-stats")] = Field(
        True, description="Record each matrix's error against its INT4 values in the manifest (same bytes; slower "
                          "on CPU).")
    fsync: bool = Field(
        True, description="Flush each finished shard to disk before recording it. --no-fsync leaves write-back to "
                          "the OS (same bytes; faster where the disk is slower than the conversion): a killed run "
                          "loses nothing, and after an OS crash or reboot a resume re-checks such shards' sha256.")
    space_check: bool = Field(
        True, description="Refuse to start when the output's disk has less free space than what is left to write "
                          "(about the source's size). --no-space-check for filesystems whose free space says "
                          "nothing (quotas, thin-provisioned or network volumes); a disk that fills then stops the "
                          "run with exit 4 and a resume continues.")

    # What decides the output bytes and config: a finished output with other values is not this conversion.
    RECORDED: ClassVar[tuple[str, ...]] = ("method", "kv_cache_quant_algo", "shared_experts", "shared_expert_scales")

    @field_validator("method")
    @classmethod
    def _weight_only(cls, value: ScaleMethod) -> ScaleMethod:
        # methods that need calibration statistics run after calibrate (requantize), never in convert
        allowed = weight_only_methods()
        if value not in allowed:
            raise ValueError(f"convert takes a weight-only method ({', '.join(m.value for m in allowed)}); "
                             f"{value.value} needs calibration statistics")
        return value

    @field_validator("method_options")
    @classmethod
    def _typed_method_options(cls, value: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        method = info.data.get("method")
        return value if method is None else checked_method_options(method, value)

    def method_config(self) -> BaseModel:
        """The method's whole typed options (`method_options` over its defaults)."""
        return typed_method_options(self.method, self.method_options)

    @field_validator("kv_cache_quant_algo", mode="before")
    @classmethod
    def _none_means_no_kv_quantization(cls, value: Any) -> Any:
        return None if isinstance(value, str) and value.lower() == "none" else value

    def recorded(self) -> dict[str, Any]:
        """The settings the manifest records for this conversion (`ConversionSettings`); the method's options where
        it has any (no weight-only method has yet, so records stay those of earlier versions)."""
        options = self.method_config().model_dump(mode="json")
        recorded = self.model_dump(mode="json", include=set(self.RECORDED))
        return {**recorded, "method_options": options} if options else recorded
