"""The one distributed test harness: run a function on W CPU ranks (gloo), collect results.

Each rank runs `fn(rank, world, *args)` with a fresh default process group and returns a
picklable value; `run_ranks` returns the values in rank order, or raises with every failing
rank's traceback. A hung collective fails the test after `timeout` seconds instead of hanging.

Ranks start from a fork server (`rank_context`), never from the test process: that process has
run torch's thread pools and inductor's compile workers, and a plain fork copies their locks and
queues without their threads, so a rank that compiles can wait for ever on a worker that does
not exist in it (seen with a cold inductor cache). The fork server is a fresh interpreter that
only imports torch and dmuon_fn (no thread pool, no compile worker is ever started in it), so
every rank starts clean and pays no import cost. `fn` and its arguments are pickled: `fn` must
be a module-level function of an importable module (every test module is).

Rendezvous without a port race: the parent opens a TCPStore server on a port the kernel picks
(`rank_store`, port 0) and keeps it open until every rank has finished; the ranks join it as
clients (`init_rank`). No port is ever closed and handed on, so nothing else on the machine can
take it in between.

Nothing outlives the test: ranks still running when `run_ranks` returns or raises (its timeout,
a failed rank, an interrupt, pytest-timeout) first dump every thread's stack to the test's
stderr, then are killed; and a rank kills itself as soon as the test process has exited,
however it ended (its fork server cannot: it lives as long as any rank it started).
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import multiprocessing
import os
import pickle
import select
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.constants import default_pg_timeout

# Imported once in the fork server, not in every rank (~3 s each on two cores).
PRELOAD = [
    "torch",
    "torch._dynamo",
    "torch.distributed.fsdp",
    "torch.distributed.checkpoint",
    "dmuon_fn",
]


def rank_context() -> multiprocessing.context.BaseContext:
    """The multiprocessing context every rank of the test suite starts from (see above)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


HOST = "127.0.0.1"


def rank_store(world: int) -> dist.TCPStore:
    """The rendezvous of one run of `world` ranks: a TCPStore server on a port the kernel picks.

    Pass its `.port` to the ranks (`init_rank`) and keep the object alive until they finish: the
    server closes with it.
    """
    return dist.TCPStore(HOST, 0, world, is_master=True, wait_for_workers=False)


def init_rank(rank: int, world: int, port: int, timeout: float | None = None) -> None:
    """Join the default gloo process group through the parent's `rank_store` at `port`.

    `timeout`: the group's collective timeout in seconds (default: torch's); the store's too, as
    with env:// rendezvous.
    """
    td = default_pg_timeout if timeout is None else datetime.timedelta(seconds=timeout)
    store = dist.TCPStore(HOST, port, world, is_master=False, timeout=td)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=td)


STACKS = signal.SIGUSR1  # a rank dumps every thread's stack to <out>/<rank>.stacks on it


def _die_with(pid: int) -> None:
    """SIGKILL this process once process `pid` has exited (a pidfd turns readable then)."""
    if not hasattr(os, "pidfd_open"):  # Linux only
        return
    fd = os.pidfd_open(pid)

    def watch() -> None:
        select.select([fd], [], [])
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="die-with-test", daemon=True).start()


def _entry(
    rank: int,
    world: int,
    port: int,
    out: str,
    fn: Callable,
    args: tuple,
    pg_timeout: float | None,
    test_pid: int,
) -> None:
    _die_with(test_pid)
    stacks = open(Path(out, f"{rank}.stacks"), "w")  # noqa: SIM115 (open for the rank's life)
    faulthandler.register(STACKS, file=stacks, all_threads=True)
    torch.set_num_threads(1)  # W ranks share the machine's cores
    result: object
    try:
        init_rank(rank, world, port, pg_timeout)
        result = ("ok", fn(rank, world, *args))
    except BaseException:  # report every rank's failure to the parent
        result = ("error", traceback.format_exc())
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    Path(out, f"{rank}.pkl").write_bytes(pickle.dumps(result))


def _stop(procs: list, out: str) -> None:
    """Dump the stacks of the ranks still running to stderr, then SIGKILL them and reap all."""
    alive = [r for r, p in enumerate(procs) if p.is_alive()]
    if alive:
        for r in alive:
            with contextlib.suppress(ProcessLookupError):  # it may have ended just now
                os.kill(procs[r].pid, STACKS)
        time.sleep(1.0)  # the dumps take milliseconds
        for r in alive:
            stacks = Path(out, f"{r}.stacks")
            text = stacks.read_text() if stacks.exists() else ""
            print(f"--- rank {r}, still running, killed:\n{text}", file=sys.stderr, flush=True)
    kill_all(procs)


def kill_all(procs: list) -> None:
    """SIGKILL every process of `procs` still running, then reap every started one."""
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        if p.pid is not None:
            p.join(timeout=30)


def run_ranks(
    fn: Callable, world: int, *args, timeout: float = 240.0, pg_timeout: float | None = None
) -> list:
    """`pg_timeout`: the process group's collective timeout in seconds (default: torch's)."""
    rank_context()
    store = rank_store(world)  # open until every rank has finished
    with tempfile.TemporaryDirectory() as out:
        ctx = mp.start_processes(
            _entry,
            args=(world, store.port, out, fn, args, pg_timeout, os.getpid()),
            nprocs=world,
            start_method="forkserver",
            join=False,
        )
        try:
            deadline = time.monotonic() + timeout
            while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"ranks did not finish within {timeout} s (a hang?)")
        finally:
            _stop(ctx.processes, out)
        results = []
        errors = []
        for r in range(world):
            status, value = pickle.loads(Path(out, f"{r}.pkl").read_bytes())
            (errors if status == "error" else results).append(
                (r, value) if status == "error" else value
            )
        if errors:
            raise AssertionError("\n".join(f"--- rank {r}:\n{tb}" for r, tb in errors))
        return results


def data_meshes(world: int, hsdp: bool):
    """(shard mesh, replicate mesh or None): 1-D over `world` ranks, or (2, world / 2) HSDP."""
    from torch.distributed.device_mesh import init_device_mesh

    if hsdp:
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
        return mesh["shard"], mesh["replicate"]
    return init_device_mesh("cpu", (world,)), None
