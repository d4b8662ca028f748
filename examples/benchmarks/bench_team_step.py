"""A model with one dominating matrix: its Muon step with one owner against a team of ranks.

The model: a 4096-row output head over d = 1024 (the dominating matrix, 4096×1024) after two
small blocks (1024 -> 256 -> 1024), every parameter dedicated (`pure=True`), on W CPU ranks
(gloo, one thread each), planned with the head on one owner (`teams={"head.weight": 1}`) and
on a team of W (`teams={"head.weight": W}`), the machine's Newton-Schulz dtype and form.
Medians over --steps steps (after one warm-up), per rank, of the CPU seconds (its thread's, what
it takes with a core of its own) of its Newton-Schulz (inside the step's `orthogonalize_with`
and `orthogonalize_team` calls) and of its whole step (guard, updates, Newton-Schulz); the
busiest and the mean rank's; and the wall seconds of a whole training step (forward, backward,
step): on a machine with fewer cores than ranks the members share cores, so wall time
understates a team. Last, the head's whole Newton-Schulz run on every rank at once: whether
sharing the cores inflates the same work's CPU seconds (the team's members always run at once,
the one owner while the others idle).

Run: python examples/benchmarks/bench_team_step.py [--world 4] [--steps 5] [--dtype float32]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from _timing import machine, run_ranks
from torch.distributed.device_mesh import init_device_mesh

import dmuon_fn as dmuon
from dmuon_fn.ns._orthogonalize import get_ns_backend
from dmuon_fn.optim import _update

D, HEAD, SMALL, BATCH = 1024, 4096, 256, 16


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(D, SMALL, bias=False), nn.Tanh(), nn.Linear(SMALL, D))
            for _ in range(2)
        )
        self.head = nn.Linear(D, HEAD, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = x + b(x)
        return self.head(x)


NS_CPU = [0.0]  # this rank's Newton-Schulz CPU seconds so far


def _timed(fn):
    def run(*args, **kwargs):
        c0 = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            NS_CPU[0] += time.thread_time() - c0

    return run


def _run(rank: int, world: int, k: int, steps: int, dtype: str | None) -> dict:
    torch.manual_seed(0)
    model = Net()
    mesh = init_device_mesh("cpu", (world,))
    dmuon.dedicate_params(model, mesh, pure=True, teams={"head.weight": k})
    opt = dmuon.Muon(model, lr=0.01, ns_dtype=getattr(torch, dtype) if dtype else None)
    g = torch.Generator().manual_seed(rank)
    cpu, wall, ns = [], [], []
    for _ in range(steps + 1):
        x, y = torch.randn(BATCH, D, generator=g), torch.randint(0, HEAD, (BATCH,), generator=g)
        dist.barrier()
        w0 = time.perf_counter()
        nn.functional.cross_entropy(model(x), y).backward()
        c0, n0 = time.thread_time(), NS_CPU[0]
        opt.step()
        cpu.append(time.thread_time() - c0)
        ns.append(NS_CPU[0] - n0)
        opt.zero_grad()
        dist.barrier()
        wall.append(time.perf_counter() - w0)
    every = [None] * world
    dist.all_gather_object(every, (statistics.median(ns[1:]), statistics.median(cpu[1:])))
    plan = model._dmuon_state.plan
    return {"ns": [e[0] for e in every], "cpu": [e[1] for e in every],
            "wall": statistics.median(wall[1:]), "team": plan.team("head.weight")}  # fmt: skip


def _at_once(rank: int, world: int, steps: int, dtype: str | None) -> list[float]:
    """Every rank's CPU seconds (median) of the head's whole Newton-Schulz, all ranks at once:
    what sharing the cores costs the same work (the one owner runs it while the others idle)."""
    G = torch.randn(HEAD, D, generator=torch.Generator().manual_seed(rank))
    cfg = {"dtype": getattr(torch, dtype)} if dtype else {}
    cpu = []
    for _ in range(steps + 1):
        dist.barrier()
        c0 = time.thread_time()
        dmuon.orthogonalize(G, **cfg)
        cpu.append(time.thread_time() - c0)
    every = [None] * world
    dist.all_gather_object(every, statistics.median(cpu[1:]))
    return every


def _rank(rank: int, world: int, steps: int, dtype: str | None) -> tuple[list[dict], list]:
    torch.set_num_threads(1)
    # Newton-Schulz as the step calls it (module globals, looked up at call time)
    _update.orthogonalize_with = _timed(_update.orthogonalize_with)
    _update.orthogonalize_team = _timed(_update.orthogonalize_team)
    runs = [_run(rank, world, k, steps, dtype) for k in (1, world)]
    return runs, _at_once(rank, world, steps, dtype)


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], help="default: the dispatch's")
    args = ap.parse_args(argv)
    (one, team), at_once = run_ranks(_rank, args.world, args.steps, args.dtype)
    lines = [
        f"# a 4096x1024 head over two small blocks, W={args.world} CPU ranks (gloo, 1 thread "
        f"each), {machine()}",
        f"# `python examples/benchmarks/bench_team_step.py {' '.join(argv or sys.argv[1:])}`",
        f"# {get_ns_backend('cpu', dtype=getattr(torch, args.dtype) if args.dtype else None)}",
        "",
        "| head on | NS CPU s, busiest rank | mean rank | step CPU s, busiest rank | mean rank |"
        " wall s per training step |",
        "|---|--:|--:|--:|--:|--:|",
    ]
    for name, r in (("one owner", one), (f"a team of {len(team['team'])}", team)):
        lines.append(
            f"| {name} | {max(r['ns']):.3f} | {statistics.fmean(r['ns']):.3f} | "
            f"{max(r['cpu']):.3f} | {statistics.fmean(r['cpu']):.3f} | {r['wall']:.3f} |"
        )
    lines += [
        "",
        f"with the team, the busiest rank's Newton-Schulz CPU: "
        f"{max(one['ns']) / max(team['ns']):.2f}x less; its step CPU: "
        f"{max(one['cpu']) / max(team['cpu']):.2f}x less; wall per training step: "
        f"{one['wall'] / team['wall']:.2f}x",
        "",
        f"the head's whole Newton-Schulz on every rank at once (no step, no collectives): "
        f"{statistics.fmean(at_once):.3f} s CPU per rank (the mean; the one owner's, alone: "
        f"{max(one['ns']):.3f} s): sharing {os.cpu_count()} cores among {args.world} ranks "
        f"costs the same work {statistics.fmean(at_once) / max(one['ns']):.2f}x",
    ]
    text = "\n".join(lines)
    print(text, flush=True)
    return text


if __name__ == "__main__":
    main()
