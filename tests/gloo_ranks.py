"""CPU ranks joined in a gloo process group as torchrun would start them: what the multi-process tests share.

    def _worker(rank, world, port, out):      # module level: the spawned processes import it by name
        with gloo_rank(rank, world, port):
            calibrate_checkpoint(Path(out), ...)

    spawn_ranks(_worker, 2, str(out))
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.multiprocessing as mp

from kimi_nvfp4.distributed import RankContext, rank_context

# loopback: the rendezvous never depends on how this machine's hostname resolves
_ADDR = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((_ADDR, 0))
        return s.getsockname()[1]


@contextmanager
def gloo_rank(rank: int, world: int, port: int) -> Iterator[RankContext]:
    """In a spawned process: torchrun's environment for `rank` of `world`, the job joined through the code under
    test (distributed.rank_context), and the group left on the way out, whether the work raised or not."""
    os.environ.update(MASTER_ADDR=_ADDR, MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    # one thread per rank, as torchrun's OMP_NUM_THREADS=1 gives: ranks sharing one machine do not oversubscribe it
    torch.set_num_threads(1)
    ctx = rank_context("cpu")
    try:
        yield ctx
    finally:
        # a gloo group left alive at exit is torn down by static destructors and can abort the process
        # (tests/test_torchrun_teardown.py); no barrier first, so a rank whose peer died does not wait for it
        torch.distributed.destroy_process_group()


def spawn_ranks(worker: Callable[..., None], world: int, *args) -> None:
    """`worker(rank, world, port, *args)` in `world` fresh processes, until all end; a rank that raised or exited
    nonzero raises here (torch.multiprocessing's ProcessRaisedException / ProcessExitedException)."""
    # spawn, not fork: each rank starts a clean interpreter, without the test process's torch threads and state
    mp.start_processes(worker, args=(world, free_port(), *args), nprocs=world, join=True, start_method="spawn")
