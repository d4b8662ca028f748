"""Device and backend for the example scripts: CUDA + NCCL when present, else CPU + gloo."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist


def init(multiple_of: int = 1) -> tuple[str, int, int]:
    """Initialize the default process group from torchrun's environment, or as one process when
    the script was started without torchrun; return (device, rank, world size). A script whose
    mesh needs a world size that is a multiple of `multiple_of` (> 1) says how to launch it
    instead of starting."""
    single = "RANK" not in os.environ
    world = 1 if single else int(os.environ["WORLD_SIZE"])
    if world % multiple_of:
        sys.exit(
            f"{sys.argv[0]} needs a multiple of {multiple_of} ranks, got {world}: e.g. "
            f"torchrun --nproc_per_node={4 if 4 % multiple_of == 0 else multiple_of} {sys.argv[0]}"
        )
    if single:
        print(
            f"one process (for several ranks: torchrun --nproc_per_node=4 {sys.argv[0]})",
            file=sys.stderr,
        )
    kw = dict(store=dist.HashStore(), rank=0, world_size=1) if single else {}
    if torch.cuda.is_available():
        dist.init_process_group("nccl", **kw)
        local = int(os.environ.get("LOCAL_RANK", dist.get_rank() % torch.cuda.device_count()))
        torch.cuda.set_device(local)
        return "cuda", dist.get_rank(), dist.get_world_size()
    ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // ranks_here))
    dist.init_process_group("gloo", **kw)
    return "cpu", dist.get_rank(), dist.get_world_size()


def finish() -> None:
    """Leave together: wait for every rank (rank 0 may still be writing results), then tear the
    process group down. A rank that closes its gloo connections while a peer is still running
    can abort the job at exit."""
    dist.barrier()
    dist.destroy_process_group()
