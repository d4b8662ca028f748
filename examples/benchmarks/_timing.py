"""Side-by-side timing helpers shared by the benchmark scripts."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import dmuon_fn as dmuon
from dmuon_fn.ns._calibrate import cpu_flags, cpu_model, spin_up


def interleaved_median(
    fns: dict[str, Callable[[], object]], reps: int = 7, warmup: bool = True
) -> dict[str, float]:
    """Median seconds per call, the candidates run round-robin so drift hits all alike; warmup:
    one call each, after `spin_up`."""
    if warmup:
        spin_up()
    for fn in fns.values() if warmup else ():
        fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {k: sorted(v)[len(v) // 2] for k, v in times.items()}


def machine() -> str:
    """The CPU by name and ISA (model, ATen capability, bf16 flags, any oneDNN ISA cap), threads,
    torch, date: numbers hold for that CPU only."""
    flags = sorted(cpu_flags() & {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "bf16"})
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA")
    return (
        f"{cpu_model()} ({torch.backends.cpu.get_cpu_capability()}; flags {' '.join(flags)}"
        f"{f'; ONEDNN_MAX_CPU_ISA={cap}' if cap else ''}), {torch.get_num_threads()} threads, "
        f"torch {torch.__version__}, {time.strftime('%Y-%m-%d')}"
    )


def polar_error(out: torch.Tensor, G: torch.Tensor) -> float:
    """‖out − U·Vᵀ‖_F / ‖U·Vᵀ‖_F against the float64 polar factor of G."""
    U, _, Vh = torch.linalg.svd(G.double(), full_matrices=False)
    P = U @ Vh
    return ((out.double() - P).norm() / P.norm()).item()


def _rank_main(rank: int, world: int, port: int, q, fn: Callable, args: tuple) -> None:
    torch.set_num_threads(1)  # W ranks share the machine's cores
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = fn(rank, world, *args)
        if rank == 0:
            q.put(result)
    finally:
        dist.destroy_process_group()


def run_ranks(fn: Callable, world: int, *args) -> object:
    """Run fn(rank, world, *args) on `world` gloo ranks; return rank 0's result.

    Ranks start from a fork server, a fresh interpreter that imports torch and nothing runs in:
    a plain fork of this process, once it has compiled or run torch's thread pools, can leave a
    rank waiting for ever on a worker thread the fork did not copy. `fn` must be a module-level
    function of the script (pickled by reference).
    """
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch._dynamo", "dmuon_fn"])
    q = ctx.SimpleQueue()
    mp.start_processes(
        _rank_main, args=(world, port, q, fn, args), nprocs=world, start_method="forkserver"
    )
    return q.get()


def counted_step(model, opt, x) -> dmuon.CommCounter:
    """One training step on batch x under a `CommCounter`: phases "fwd+bwd" (until dmuon_fn's
    gradients have landed) and "step" (with the HSDP publish); zero_grad after, uncounted."""
    comm = dmuon.CommCounter()
    with comm:
        with comm.phase("fwd+bwd"):
            model(x).backward()
            if isinstance(opt, dmuon.Muon):
                dmuon.wait_gradients(model)
        with comm.phase("step"):
            opt.step()
            if isinstance(opt, dmuon.Muon):
                opt.wait_publish()
    opt.zero_grad()
    return comm
