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
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import pickle
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(
    rank: int, world: int, port: int, out: str, fn: Callable, args: tuple, pg_timeout: float | None
) -> None:
    torch.set_num_threads(1)  # W ranks share the machine's cores
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    result: object
    try:
        kw = {} if pg_timeout is None else {"timeout": datetime.timedelta(seconds=pg_timeout)}
        dist.init_process_group("gloo", rank=rank, world_size=world, **kw)
        result = ("ok", fn(rank, world, *args))
    except BaseException:  # report every rank's failure to the parent
        result = ("error", traceback.format_exc())
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    Path(out, f"{rank}.pkl").write_bytes(pickle.dumps(result))


def run_ranks(
    fn: Callable, world: int, *args, timeout: float = 240.0, pg_timeout: float | None = None
) -> list:
    """`pg_timeout`: the process group's collective timeout in seconds (default: torch's)."""
    rank_context()
    with tempfile.TemporaryDirectory() as out:
        ctx = mp.start_processes(
            _entry,
            args=(world, free_port(), out, fn, args, pg_timeout),
            nprocs=world,
            start_method="forkserver",
            join=False,
        )
        deadline = time.monotonic() + timeout
        while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                raise TimeoutError(f"ranks did not finish within {timeout} s (a hang?)")
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
