"""Plan a conversion from config.json and shard headers alone, and fail before anything is written
(formats: docs/formats.md §1 in, §2 out).

The plan checks the quantization scheme, every routed-expert tensor's name, dtype and shape
against the config, each `weight_shape` value (8 bytes each), the router, and that no compressed
tensor hides outside the routed experts. It then makes one job per source shard: the tensors
copied through, and the expert matrices to convert, in groups that share one `weight_scale_2`
(an expert's gate+up — one fused w13 GEMM in the engines: SGLang's TRT-LLM/CUTLASS paths use both
halves of `w13_weight_scale_2`, its Marlin path keeps gate's, modelopt_quant.py
`ModelOptNvFp4FusedMoEMethod.process_weights_after_loading` — and each down alone). A group is
converted by every shard that holds one of its `weight_packed` tensors, reading partners from
other shards; each output tensor goes to the shard of its source `weight_packed`. So shards are
independent (parallel, resumable) and the output keeps the source's shard names.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..checkpoint.layout import PROJS, CheckpointLayout, parse_expert_name
from ..checkpoint.modelopt_config import bf16_linear_modules
from ..checkpoint.reader import CONFIG_NAME, INDEX_NAME, CheckpointReader, TensorInfo
from ..checkpoint.source_checks import (
    COMPRESSED_SUFFIXES,
    INT4_EXPERT_SUFFIXES,
    check_quantization_config,
    expected_int4_tensors,
    expert_matrix_shape,
)
from ..checkpoint.tensor_io import ShardFiles
from ..checkpoint.writer import TensorSpec
from ..errors import CheckpointError, UnsupportedCheckpointError
from ..numerics.constants import INT4_GROUP_SIZE
from .nvfp4_outputs import Nvfp4Outputs
from .shared_experts import SHARED_SCALE_PROJS, DenseMatrix, DenseScaleGroup, SharedExperts, plan_shared_experts
from .source_files import SkippedFile, require_regular, select_source_files

# Output tensors of one NVFP4 linear (ModelOpt HF export names).
NVFP4_SUFFIXES = ("weight", "weight_scale", "weight_scale_2")


@dataclass(frozen=True)
class ExpertMatrix(Nvfp4Outputs):
    """One INT4 routed-expert linear in the source."""

    module: str  # e.g. language_model.model.layers.3.mlp.experts.17.up_proj
    out_features: int
    in_features: int
    packed: TensorInfo
    scale: TensorInfo

    @property
    def int4_bytes(self) -> int:
        return self.packed.nbytes + self.scale.nbytes


@dataclass(frozen=True)
class ScaleGroup:
    """Matrices that share one weight_scale_2: (gate_proj, up_proj) of an expert, or (down_proj,)."""

    matrices: tuple[ExpertMatrix, ...]


@dataclass
class ShardJob:
    file: str  # source shard = output shard name
    passthrough: list[TensorInfo] = field(default_factory=list)
    groups: list[ScaleGroup] = field(default_factory=list)
    # BF16 shared experts quantized here (`--shared-experts nvfp4`; shared_experts.py), written after passthrough
    dense_groups: list[DenseScaleGroup] = field(default_factory=list)

    def writes(self, m: ExpertMatrix | DenseMatrix) -> bool:
        """Whether this shard holds the matrix's output (its weight_packed, or BF16 weight, lives here)."""
        source = m.packed if isinstance(m, ExpertMatrix) else m.weight
        return source.file == self.file

    @property
    def dense_matrices(self) -> list[DenseMatrix]:
        """The shared-expert matrices this shard writes."""
        return [m for g in self.dense_groups for m in g.matrices if self.writes(m)]

    @property
    def input_bytes(self) -> int:
        own = sum(t.nbytes for t in self.passthrough) + sum(m.weight.nbytes for m in self.dense_matrices)
        return own + sum(m.int4_bytes for g in self.groups for m in g.matrices if self.writes(m))

    @property
    def int4_input_bytes(self) -> int:
        return sum(m.int4_bytes for g in self.groups for m in g.matrices if self.writes(m))

    @property
    def output_bytes(self) -> int:
        dense = sum(m.output_bytes for m in self.dense_matrices)
        return sum(t.nbytes for t in self.passthrough) + dense + sum(
            m.output_bytes for g in self.groups for m in g.matrices if self.writes(m)
        )

    def output_specs(self) -> list[TensorSpec]:
        """Every output tensor of this shard in the order the job produces it (the file's layout)."""
        specs = [TensorSpec(t.name, t.dtype, tuple(t.shape)) for t in self.passthrough]
        for m in self.dense_matrices:
            specs += [TensorSpec(n, dtype, shape) for n, (dtype, shape) in m.output_specs().items()]
        for group in self.groups:
            for m in group.matrices:
                if self.writes(m):
                    specs += [TensorSpec(n, dtype, shape) for n, (dtype, shape) in m.output_specs().items()]
        return specs


@dataclass
class ConversionPlan:
    root: Path
    config: dict
    layout: CheckpointLayout
    jobs: list[ShardJob]
    weight_map: dict[str, str]  # output tensor -> output shard
    total_size: int  # output tensor bytes (index metadata.total_size)
    bf16_linears: list[str]
    quantized_modules: list[str]
    other_files: list[Path]  # copied byte for byte (source_files.py)
    skipped_files: list[SkippedFile] = field(default_factory=list)  # left out of the output, with the reason
    trusted_root: Path | None = None  # the tree the source's files may link into (source_files.py)

    shared_experts: SharedExperts = SharedExperts.BF16

    @property
    def matrices(self) -> int:
        return sum(1 for j in self.jobs for g in j.groups for m in g.matrices if j.writes(m))

    @property
    def input_bytes(self) -> int:
        return sum(j.input_bytes for j in self.jobs)

    @property
    def int4_input_bytes(self) -> int:
        return sum(j.int4_input_bytes for j in self.jobs)


def _check_dims(layout: CheckpointLayout) -> None:
    c = layout.text
    for key, value in (("hidden_size", c.hidden_size), ("moe_intermediate_size", c.moe_intermediate_size)):
        if value % INT4_GROUP_SIZE:
            raise UnsupportedCheckpointError(
                f"{key} {value} is not a multiple of the INT4 group size {INT4_GROUP_SIZE}", file="config.json"
            )


def _check_tensor(info: TensorInfo, dtype: torch.dtype, shape: tuple[int, ...], why: str) -> None:
    if info.dtype != dtype or tuple(info.shape) != tuple(shape):
        raise CheckpointError(
            f"is {info.dtype} {list(info.shape)}, expected {dtype} {list(shape)} ({why})", file=info.file, tensor=info.name
        )


def _collect_experts(reader: CheckpointReader, layout: CheckpointLayout) -> dict[str, ExpertMatrix]:
    """Every routed-expert matrix the config promises, checked against the headers."""
    c = layout.text
    tensors = reader.tensors
    moe_layers = set(c.moe_layers)
    for name, info in tensors.items():
        parsed = parse_expert_name(name)
        if parsed is None:
            if name.endswith(COMPRESSED_SUFFIXES):
                raise UnsupportedCheckpointError(
                    "compressed tensor outside the routed experts; only routed experts may be INT4",
                    file=info.file,
                    tensor=name,
                )
            continue
        if parsed.layer not in moe_layers or parsed.expert >= c.n_routed_experts or parsed.suffix not in INT4_EXPERT_SUFFIXES:
            raise CheckpointError(
                f"unexpected routed-expert tensor (config: MoE layers {c.moe_layers[:1]}..{c.moe_layers[-1:]}, "
                f"{c.n_routed_experts} experts, suffixes {INT4_EXPERT_SUFFIXES})",
                file=info.file,
                tensor=name,
            )
    experts: dict[str, ExpertMatrix] = {}
    for layer in c.moe_layers:
        for e in range(c.n_routed_experts):
            for proj in PROJS:
                module = layout.expert_module(layer, e, proj)
                out_f, in_f = expert_matrix_shape(layout, proj)
                for suffix, (dtype, shape) in expected_int4_tensors(out_f, in_f).items():
                    name = f"{module}.{suffix}"
                    if name not in tensors:
                        raise CheckpointError(
                            f"missing from the checkpoint index (config promises {c.n_routed_experts} INT4 experts "
                            f"in layer {layer})",
                            file="model.safetensors.index.json",
                            tensor=name,
                        )
                    _check_tensor(tensors[name], dtype, shape, f"pack-quantized INT4 [{out_f}, {in_f}] group {INT4_GROUP_SIZE}")
                experts[module] = ExpertMatrix(
                    module, out_f, in_f, tensors[f"{module}.weight_packed"], tensors[f"{module}.weight_scale"]
                )
    return experts


def _check_weight_shapes(reader: CheckpointReader, experts: dict[str, ExpertMatrix]) -> None:
    """weight_shape holds [out, in]; it must agree with the packed size (8 bytes each, read here)."""
    with ShardFiles(reader.root) as files:
        for module, m in experts.items():
            info = reader.tensors[f"{module}.weight_shape"]
            value = files.read(info.file, info.name).tolist()
            if value != [m.out_features, m.in_features]:
                raise CheckpointError(
                    f"weight_shape is {value} but weight_packed {list(m.packed.shape)} and the config give "
                    f"[{m.out_features}, {m.in_features}]",
                    file=info.file,
                    tensor=info.name,
                )


def _check_routers(reader: CheckpointReader, layout: CheckpointLayout) -> None:
    """Router shapes and bias dtype; and the bias values (384 floats a layer): a NaN/Inf bias decides every
    token's experts, so it is refused here, before anything is written."""
    c = layout.text
    with ShardFiles(reader.root) as files:
        for layer in c.moe_layers:
            p = layout.layer_prefix(layer)
            for name, dtype, shape in (
                (f"{p}mlp.gate.weight", None, (c.n_routed_experts, c.hidden_size)),
                (f"{p}mlp.gate.e_score_correction_bias", torch.float32, (c.n_routed_experts,)),
            ):
                info = reader.tensors.get(name)
                if info is None:
                    raise CheckpointError("router tensor is missing from the checkpoint index", file="model.safetensors.index.json", tensor=name)
                _check_tensor(info, dtype or info.dtype, shape, "router")
                if dtype is not None:
                    bad = int((~torch.isfinite(files.read(info.file, info.name))).sum())
                    if bad:
                        raise CheckpointError(f"{bad} NaN/Inf values in the router bias; expected finite float32",
                                              file=info.file, tensor=name)


def _check_every_tensor_indexed(reader: CheckpointReader) -> None:
    """A tensor a shard holds but the index does not name would silently be missing from the output."""
    for file, names in sorted(reader.unindexed_tensors.items()):
        more = f" (and {len(names) - 1} more)" if len(names) > 1 else ""
        raise CheckpointError(f"the shard holds this tensor but the index does not name it{more}; expected every "
                              f"tensor of the shard in {INDEX_NAME}", file=file, tensor=names[0])


def _scale_groups(layout: CheckpointLayout, experts: dict[str, ExpertMatrix]) -> list[ScaleGroup]:
    groups = []
    for layer in layout.text.moe_layers:
        for e in range(layout.text.n_routed_experts):
            groups.append(ScaleGroup(tuple(experts[layout.expert_module(layer, e, p)] for p in SHARED_SCALE_PROJS)))
            groups.append(ScaleGroup((experts[layout.expert_module(layer, e, "down_proj")],)))
    return groups


def plan_conversion(
    source_root: str | Path,
    trusted_root: str | Path | None = None,
    shared_experts: SharedExperts | str = SharedExperts.BF16,
) -> ConversionPlan:
    """Check the source and decide every output tensor. Reads headers, weight_shape values and router biases only.

    `trusted_root`: the tree the source's files may link into (default the folder itself; for a Hub download the
    repo's cache folder, see convert/source.py). Anything else a file links to is refused or left out.
    `shared_experts`: `bf16` copies the shared experts through (and excludes them), `nvfp4` quantizes them.
    """
    shared_experts = SharedExperts(shared_experts)
    root = Path(source_root)
    trusted = Path(trusted_root) if trusted_root is not None else root
    for name in (CONFIG_NAME, INDEX_NAME):
        if os.path.lexists(root / name):
            require_regular(root, trusted, name, name)
    reader = CheckpointReader(source_root)
    for file in reader.shard_files:
        require_regular(root, trusted, file, "shard")
    layout = reader.layout
    check_quantization_config(reader.config)
    _check_dims(layout)
    _check_every_tensor_indexed(reader)
    experts = _collect_experts(reader, layout)
    _check_weight_shapes(reader, experts)
    _check_routers(reader, layout)

    dense_groups = plan_shared_experts(layout, reader.tensors) if shared_experts is SharedExperts.NVFP4 else []
    dense = {m.module: m for g in dense_groups for m in g.matrices}
    int4_names = {f"{m}.{s}" for m in experts for s in INT4_EXPERT_SUFFIXES}
    converted = int4_names | {m.weight.name for m in dense.values()}  # source tensors that do not pass through
    jobs = {file: ShardJob(file) for file in reader.shard_files}
    for name, info in sorted(reader.tensors.items()):
        if name not in converted:
            jobs[info.file].passthrough.append(info)
    for dense_group in dense_groups:
        for file in sorted({m.weight.file for m in dense_group.matrices}):
            jobs[file].dense_groups.append(dense_group)
    for group in _scale_groups(layout, experts):
        for file in sorted({m.packed.file for m in group.matrices}):
            jobs[file].groups.append(group)

    weight_map: dict[str, str] = {}
    total = 0
    for job in jobs.values():
        for info in job.passthrough:
            weight_map[info.name] = job.file
            total += info.nbytes
        # a shared expert quantized here, then the routed experts whose weights this shard holds
        outputs = [*job.dense_matrices, *(m for g in job.groups for m in g.matrices if job.writes(m))]
        for m in outputs:
            for name in m.output_specs():
                if name in reader.tensors and name not in converted:
                    raise CheckpointError(
                        "the source already has a tensor named like a converted output", file=reader.tensors[name].file, tensor=name
                    )
                weight_map[name] = job.file
            total += m.output_bytes
    bf16 = [m for m in bf16_linear_modules(reader) if m not in dense]
    files = select_source_files(reader.root, set(reader.shard_files), trusted)
    return ConversionPlan(
        root=reader.root,
        config=reader.config,
        layout=layout,
        jobs=[jobs[f] for f in sorted(jobs)],
        weight_map=weight_map,
        total_size=total,
        bf16_linears=bf16,
        quantized_modules=sorted([*experts, *dense]),
        other_files=files.copy,
        skipped_files=files.skipped,
        trusted_root=trusted,
        shared_experts=shared_experts,
    )
