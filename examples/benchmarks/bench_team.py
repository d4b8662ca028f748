"""One dominating matrix's Newton-Schulz: one owner against a team of ranks (orthogonalize_team).

W CPU ranks (gloo, one thread each). For each shape, the whole matrix orthogonalized by one
owner (the other ranks idle, as with one owner per matrix) and by teams of 2 and W ranks, each
member holding an even slice of the long side (`dmuon_fn.orthogonalize_team`), all in the
dtype and form the machine's dispatch picks (per member share for a team). Per configuration,
medians over --reps calls of: the busiest rank's CPU seconds (its thread's, compute only: what
it would take with a core of its own) and the wall seconds of the call (the slowest member; on a
machine with fewer cores than ranks the members share cores, so wall time understates a team),
the ratio one owner / team for both, the bytes each member all-reduces per call, and the
largest difference from the one-owner result (relative Frobenius).

Run: python examples/benchmarks/bench_team.py [--world 4] [--reps 5] [--shapes 4096x1024,...]
    [--dtype float32]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.distributed as dist
from _timing import machine, run_ranks

import dmuon_fn as dmuon
from dmuon_fn.ns._orthogonalize import get_ns_backend, orthogonalize_with


def _call(fn) -> tuple[float, float]:
    """(thread CPU seconds, wall seconds) of fn() on this rank, the ranks started together."""
    dist.barrier()
    c0, w0 = time.thread_time(), time.perf_counter()
    fn()
    return time.thread_time() - c0, time.perf_counter() - w0


def _rank(rank: int, world: int, shapes, reps: int, dtype: str | None) -> list[dict]:
    cfg = dmuon.NSConfig(dtype=getattr(torch, dtype) if dtype else None)
    out = []
    for shape in shapes:
        W = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
        dim = -1 if shape[-1] >= shape[-2] else -2
        whole = orthogonalize_with(W, cfg) if rank == 0 else None
        rows = {}
        teams = sorted({1, 2, world})
        for k in teams:
            group = dist.new_group(list(range(k)))  # every rank creates every group
            if k == 1:
                run = (lambda: orthogonalize_with(W, cfg)) if rank == 0 else (lambda: None)
                part = None
            else:
                n = shape[dim]
                lo, hi = rank * n // k, (rank + 1) * n // k
                part = W.narrow(dim, lo, hi - lo) if rank < k else None

                def run(part=part, group=group, cfg=cfg):
                    if part is not None:
                        return dmuon.orthogonalize_team(part, group, shape, dim=dim, cfg=cfg)
                    return None

            run()  # warm-up (and the dispatch's measurement on first use)
            times = [_call(run) for _ in range(reps)]
            cpu = statistics.median(t[0] for t in times)
            wall = statistics.median(t[1] for t in times)
            res = run()
            stats = torch.tensor([cpu, wall], dtype=torch.float64)
            every = [torch.zeros_like(stats) for _ in range(world)]
            dist.all_gather(every, stats)
            pieces = [None] * world
            dist.all_gather_object(pieces, res)
            err = None
            if rank == 0:
                got = whole if k == 1 else torch.cat([p for p in pieces[:k]], dim=dim)
                err = ((got - whole).norm() / whole.norm()).item()
            rows[k] = dict(
                cpu=max(float(e[0]) for e in every),
                wall=max(float(e[1]) for e in every),
                err=err,
            )
        out.append(dict(shape=shape, dim=dim, rows=rows))
    return out


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--shapes", default="4096x1024,1024x4096,2048x2048")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], help="default: the dispatch's")
    args = ap.parse_args(argv)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    res = run_ranks(_rank, args.world, shapes, args.reps, args.dtype)
    lines = [
        f"# one matrix's Newton-Schulz: one owner vs a team, W={args.world} CPU ranks (gloo, "
        f"1 thread each), {machine()}",
        f"# `python examples/benchmarks/bench_team.py {' '.join(argv or sys.argv[1:])}`".rstrip(),
        f"# {get_ns_backend('cpu', dtype=getattr(torch, args.dtype) if args.dtype else None)}",
        "",
        "| shape | ranks on it | busiest CPU s | wall s | one owner / this, CPU | one owner / this,"
        " wall | all-reduce bytes per member | max rel. difference from one owner |",
        "|---|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for r in res:
        m = min(r["shape"])
        one = r["rows"][1]
        for k, row in r["rows"].items():
            reduces = "-" if k == 1 else f"m²·4 = {4 * m * m:,} per all-reduce"
            lines.append(
                f"| {r['shape'][0]}x{r['shape'][1]} | {k} | {row['cpu']:.3f} | {row['wall']:.3f}"
                f" | {one['cpu'] / row['cpu']:.2f}x | {one['wall'] / row['wall']:.2f}x |"
                f" {reduces} | {row['err']:.1e} |"
            )
    text = "\n".join(lines)
    print(text, flush=True)
    return text


if __name__ == "__main__":
    main()
