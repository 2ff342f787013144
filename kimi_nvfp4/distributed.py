"""Data parallelism for the model stages under `torchrun` (or `kimi-nvfp4 --gpus N ...`).

Calibrate and validate split the token sequences over ranks (rank r takes sequences r, r+N, r+2N, ...);
every rank streams the same layer (on one host the page cache reads it once) and the statistics are
combined after each layer, so the results do not depend on the number of ranks:

- maxima (the input amax an `input_scale` is made from) are exact under any reduction order: the
  scales are bit-identical for 1 or N ranks as long as each token's activations are (they are
  row-local computations; see docs/calibrate.md for the GEMM caveat);
- sums (channel energies, KL, squared errors) are added in rank order, in fp64: equal to the
  one-process figures up to the reduction order (relative 1e-9 on the demo; tests/test_distributed.py).

NCCL on CUDA, gloo on CPU. Multi-node assumes every node sees the checkpoint and the output folder at
the same path (a shared filesystem); rank 0 alone writes artifacts and the others wait for it.
Without torchrun's environment (WORLD_SIZE unset or 1) everything here is a no-op.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any, Sequence, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")

# torchrun's environment (torch.distributed.run): these name the process's place in the job.
ENV_RANK, ENV_WORLD_SIZE, ENV_LOCAL_RANK = "RANK", "WORLD_SIZE", "LOCAL_RANK"


@dataclass(frozen=True)
class RankContext:
    """This process's place in a data-parallel job (rank 0 of 1 when not distributed)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def device(self, device: torch.device) -> torch.device:
        """The device this rank computes on: `cuda` becomes `cuda:<local rank>` under torchrun."""
        if self.distributed and device.type == "cuda":
            return torch.device("cuda", self.local_rank)
        return device

    def shard(self, items: Sequence[T]) -> list[T]:
        """This rank's share of `items`: every world_size-th item from position `rank`."""
        return list(items[self.rank :: self.world_size])

    # --- collectives (identity when not distributed) --------------------------------------------
    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order."""
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def all_reduce_max_(self, t: torch.Tensor) -> torch.Tensor:
        if self.distributed:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t

    def all_reduce_sum_(self, t: torch.Tensor) -> torch.Tensor:
        """In-place sum over ranks; every rank receives the same bytes (the backend reduces each
        element once and broadcasts it), in the backend's order: equal to a one-process sum up to
        the order of additions."""
        if self.distributed:
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t

    def sum_in_rank_order(self, t: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of `t`, added in rank order on every rank (the same bytes everywhere,
        unlike an all-reduce whose order is the backend's)."""
        if not self.distributed:
            return t
        parts = self.all_gather_object(t.detach().cpu())
        total = parts[0].clone()
        for p in parts[1:]:
            total += p
        return total.to(t.device)

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank."""
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    try:
        return int(value) if value is not None else default
    except ValueError as e:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from e


def rank_context(device: torch.device | str | None = None) -> RankContext:
    """The job this process belongs to, joining its process group on first use (NCCL when `device` is
    CUDA, else gloo). Without torchrun's environment: a single process."""
    if dist.is_available() and dist.is_initialized():
        return RankContext(dist.get_rank(), dist.get_world_size(), _env_int(ENV_LOCAL_RANK, dist.get_rank()))
    world = _env_int(ENV_WORLD_SIZE, 1)
    if world <= 1:
        return RankContext()
    rank, local = _env_int(ENV_RANK, 0), _env_int(ENV_LOCAL_RANK, 0)
    use_cuda = device is not None and torch.device(device).type == "cuda"
    if use_cuda:
        torch.cuda.set_device(local)
    dist.init_process_group(backend="nccl" if use_cuda else "gloo")
    return RankContext(rank, world, local)


def is_main_process() -> bool:
    """Rank 0, or not under torchrun: the one process of a job that prints summaries (from torchrun's environment,
    so it holds before the process group is joined)."""
    return _env_int(ENV_WORLD_SIZE, 1) <= 1 or _env_int(ENV_RANK, 0) == 0


def shutdown(*, wait_for_peers: bool = True) -> None:
    """Leave the job cleanly before the interpreter exits: join this process's layer-prefetch threads, wait at a
    barrier for every rank to finish, then destroy the process group.

    A gloo process group left alive at exit is torn down by static destructors while its own threads (and a
    peer's last send) may still run; a joinable std::thread destroyed that way is `std::terminate`: "terminate
    called without an active exception", SIGABRT, torchrun exit 1 after the work was done. Destroying it here,
    once every rank has arrived, joins those threads while Python still runs. Idempotent; a no-op outside a job.
    """
    from .model.runner import close_prefetch_threads

    close_prefetch_threads()
    if not (dist.is_available() and dist.is_initialized()):
        return
    if wait_for_peers:  # no rank tears its group down while a peer still talks to it (not on failure: no deadlock)
        try:
            dist.barrier()
        except Exception:  # noqa: BLE001 - a peer died (its error is the job's); still release our side
            pass
    dist.destroy_process_group()


def torchrun_command(gpus: int, argv: Sequence[str]) -> list[str]:
    """`kimi-nvfp4 --gpus N CMD ...` -> the torchrun line that runs CMD on N processes of this node
    (several nodes: run torchrun yourself with --nnodes/--rdzv-endpoint, see docs/distributed.md)."""
    if gpus < 1:
        raise ValueError(f"--gpus must be at least 1, got {gpus}")
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={gpus}", "--standalone",
            "-m", "kimi_nvfp4", *argv]
