"""Device and backend for the example scripts: CUDA + NCCL when present, else CPU + gloo."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def init() -> tuple[str, int, int]:
    """Initialize the default process group from torchrun's environment; return (device, rank,
    world size)."""
    if torch.cuda.is_available():
        dist.init_process_group("nccl")
        local = int(os.environ.get("LOCAL_RANK", dist.get_rank() % torch.cuda.device_count()))
        torch.cuda.set_device(local)
        return "cuda", dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["LOCAL_WORLD_SIZE"])))
    dist.init_process_group("gloo")
    return "cpu", dist.get_rank(), dist.get_world_size()


def finish() -> None:
    """Leave together: wait for every rank (rank 0 may still be writing results), then tear the
    process group down. A rank that closes its gloo connections while a peer is still running
    can abort the job at exit."""
    dist.barrier()
    dist.destroy_process_group()
