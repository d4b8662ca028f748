"""Eager vs torch.compile(fullgraph=True) functional training step, on W forked CPU ranks.

examples/model.py's TinyGPT, every parameter dedicated (Muon on matrices, AdamW on the rest).
Prints median step time eager and compiled (inductor), their ratio, the first compiled step's
time (compile included), graphs / graph breaks / recompiles over the run, and the peak resident
memory of each rank (max RSS) in each mode next to a full replica (the model, its gradients and
AdamW state on every rank) for scale. Run: python examples/benchmarks/bench_compile.py [--world 4]
"""

from __future__ import annotations

import argparse
import math
import os
import resource
import statistics
import sys
import time

import torch
import torch.distributed as dist
from _timing import machine, run_forked
from torch._dynamo.utils import counters
from torch.distributed.device_mesh import init_device_mesh

import dmuon_fn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from compile_step import tokens
from model import TinyGPT


def _rank(rank, world, mode, args):
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    torch.manual_seed(0)
    model = TinyGPT(d=args.d, n_layers=args.layers)
    if mode == "replica":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        times = []
        for step in range(args.steps):
            t0 = time.perf_counter()
            opt.zero_grad()
            model(tokens(step, rank)).backward()
            opt.step()
            times.append(time.perf_counter() - t0)
        first = times[0]
    else:
        mesh = init_device_mesh("cpu", (world,))
        fn_plan = dmuon_fn.plan(model, mesh)
        state = dmuon_fn.init(model, fn_plan)

        def loss_fn(params, batch):
            return torch.func.functional_call(model, params, (batch,))

        def step_fn(state, batch, lr):
            loss, grads = dmuon_fn.value_and_grad(loss_fn, fn_plan)(state.params, batch)
            return loss, dmuon_fn.update(grads, state, lr=lr, adamw_lr=lr * 0.1)

        if mode == "compiled":
            counters.clear()
            step_fn = torch.compile(step_fn, fullgraph=True)
        times = []
        for step in range(args.steps):
            lr = torch.tensor(0.02 * 0.5 * (1 + math.cos(math.pi * step / args.steps)))
            dist.barrier()
            t0 = time.perf_counter()
            _, state = step_fn(state, tokens(step, rank), lr)
            times.append(time.perf_counter() - t0)
        first = times[0]
    rss = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024
    out = dict(step=statistics.median(times[2:]), first=first, rss=rss)
    if mode == "compiled":
        out.update(
            graphs=counters["stats"]["unique_graphs"], breaks=sum(counters["graph_break"].values())
        )
    gathered = [None] * world
    dist.all_gather_object(gathered, out)
    return gathered


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    args = ap.parse_args()
    res = {m: run_forked(_rank, args.world, m, args) for m in ("eager", "compiled", "replica")}
    n_params = sum(p.numel() for p in TinyGPT(d=args.d, n_layers=args.layers).parameters())
    print(
        f"# compiled functional step, W={args.world} CPU ranks (gloo, 1 thread each), TinyGPT "
        f"d={args.d} layers={args.layers} ({n_params / 1e6:.2f}M params), {machine()}"
    )
    print("| mode | median step ms (max over ranks) | first step s | peak RSS MiB (max rank) |")
    print("|---|---|---|---|")
    names = {
        "eager": "functional, eager",
        "compiled": "functional, torch.compile fullgraph",
        "replica": "full replica + AdamW (reference for memory)",
    }
    for m, rows in res.items():
        print(
            f"| {names[m]} | {max(r['step'] for r in rows) * 1e3:.1f} "
            f"| {max(r['first'] for r in rows):.1f} | {max(r['rss'] for r in rows):.0f} |"
        )
    c = res["compiled"][0]
    ratio = max(r["step"] for r in res["eager"]) / max(r["step"] for r in res["compiled"])
    print(
        f"\neager/compiled step time: {ratio:.2f}x; graphs={c['graphs']} "
        f"graph_breaks={c['breaks']} recompiles={c['graphs'] - 1} over {args.steps} steps "
        "with a cosine lr schedule"
    )


if __name__ == "__main__":
    main()
