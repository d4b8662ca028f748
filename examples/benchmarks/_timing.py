"""Side-by-side timing helpers shared by the benchmark scripts."""

from __future__ import annotations

import os
import platform
import socket
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def interleaved_median(fns: dict[str, Callable[[], object]], reps: int = 7) -> dict[str, float]:
    """Median seconds per call, the candidates run round-robin so drift hits all alike."""
    for fn in fns.values():
        fn()  # warm-up
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {k: sorted(v)[len(v) // 2] for k, v in times.items()}


def machine() -> str:
    return (
        f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
        f"torch {torch.__version__}, {time.strftime('%Y-%m-%d')}"
    )


def polar_error(out: torch.Tensor, G: torch.Tensor) -> float:
    """‖out − U·Vᵀ‖_F / ‖U·Vᵀ‖_F against the float64 polar factor of G."""
    U, _, Vh = torch.linalg.svd(G.double(), full_matrices=False)
    P = U @ Vh
    return ((out.double() - P).norm() / P.norm()).item()


def _forked(rank: int, world: int, port: int, q, fn: Callable, args: tuple) -> None:
    torch.set_num_threads(1)  # forked children otherwise hang in OpenMP
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = fn(rank, world, *args)
        if rank == 0:
            q.put(result)
    finally:
        dist.destroy_process_group()


def run_forked(fn: Callable, world: int, *args) -> object:
    """Run fn(rank, world, *args) on `world` forked gloo ranks; return rank 0's result."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    q = mp.get_context("fork").SimpleQueue()
    mp.start_processes(_forked, args=(world, port, q, fn, args), nprocs=world, start_method="fork")
    return q.get()
