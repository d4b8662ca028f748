"""The one distributed test harness: run a function on W forked CPU ranks (gloo), collect results.

Each rank runs `fn(rank, world, *args)` with a fresh default process group and returns a
picklable value; `run_ranks` returns the values in rank order, or raises with every failing
rank's traceback. A hung collective fails the test after `timeout` seconds instead of hanging.
"""

from __future__ import annotations

import datetime
import os
import pickle
import socket
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import torch._dynamo  # imported once before forking: fully_shard imports it, ~3 s per rank
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(
    rank: int, world: int, port: int, out: str, fn: Callable, args: tuple, pg_timeout: float | None
) -> None:
    torch.set_num_threads(1)  # forked children otherwise hang in OpenMP
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
    with tempfile.TemporaryDirectory() as out:
        ctx = mp.start_processes(
            _entry,
            args=(world, _free_port(), out, fn, args, pg_timeout),
            nprocs=world,
            start_method="fork",
            join=False,
        )
        import time

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
