"""The object API eager vs each transformer block under torch.compile, on W CPU ranks.

examples/model.py's TinyGPT: dedicate_params on the blocks' projection matrices, each block
wrapped in torch.compile(fullgraph=True) (inductor) and then fully_shard (torchtitan's order),
fully_shard on the root, dmuon_fn.Muon with a cosine lr schedule; for reference, the same model
with no dedicated parameter (FSDP2 + AdamW: what compiling buys without dmuon_fn). Each rank
trains an eager and a compiled copy, their steps interleaved (the machine's load hits both
alike). Prints, for Z3 and Z2, the median step time (max over ranks) eager and compiled side by
side, the first step's time (compile included; inductor's caches are off: a cold compile, every
rank compiling at once), graphs / graph breaks / recompiles, and the last loss of each run (the
same data: they agree to rounding).
Run: python examples/benchmarks/bench_compile_blocks.py [--world 4]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
import warnings

import torch
import torch.distributed as dist
from _timing import machine, run_ranks
from torch._dynamo.utils import counters
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import dmuon_fn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from compile_step import tokens
from model import TinyGPT


def _build(world, z3, dedicate, compiled, args):
    torch.manual_seed(0)
    model = TinyGPT(d=args.d, n_layers=args.layers)
    mesh = init_device_mesh("cpu", (world,))
    if dedicate:
        dmuon_fn.dedicate_params(
            model, mesh, lambda n, p: "proj" in n and p.ndim == 2, reshard_after_forward=z3
        )
    if compiled:
        for i, block in enumerate(model.blocks):
            model.blocks.register_module(str(i), torch.compile(block, fullgraph=True))
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=z3)
    fully_shard(model, mesh=mesh, reshard_after_forward=z3)
    if dedicate:
        opt = dmuon_fn.Muon(model, lr=0.02, adamw_lr=1e-3)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: 0.5 * (1 + math.cos(math.pi * s / args.steps))
    )
    return model, opt, sched


def _rank(rank, world, z3, dedicate, args):
    """Both models on every rank, their steps interleaved so load changes hit both alike."""
    counters.clear()
    torch._dynamo.reset()
    runs = {c: _build(world, z3, dedicate, c, args) for c in (False, True)}
    times: dict[bool, list[float]] = {False: [], True: []}
    loss, graphs = {}, []
    for step in range(args.steps):
        for c, (model, opt, sched) in runs.items():
            dist.barrier()
            t0 = time.perf_counter()
            opt.zero_grad()
            loss[c] = model(tokens(step, rank))
            loss[c].backward()
            opt.step()
            sched.step()
            times[c].append(time.perf_counter() - t0)
        graphs.append(counters["stats"]["unique_graphs"])
    out = {
        c: dict(step=statistics.median(t[2:]), first=t[0], loss=loss[c].item())
        for c, t in times.items()
    }
    out.update(
        graphs=graphs[-1],
        recompiles=graphs[-1] - graphs[0],
        breaks=sum(counters["graph_break"].values()),
    )
    gathered = [None] * world
    dist.all_gather_object(gathered, out)
    return gathered


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    args = ap.parse_args()
    torch.compiler.config.force_disable_caches = True  # measure a cold compile
    warnings.filterwarnings("ignore", message="dynamo_pgo force disabled")
    res = {
        (z3, d): run_ranks(_rank, args.world, z3, d, args)
        for d in (True, False)
        for z3 in (True, False)
    }
    n_params = sum(p.numel() for p in TinyGPT(d=args.d, n_layers=args.layers).parameters())
    print(
        f"# object API, per-block torch.compile, W={args.world} CPU ranks (gloo, 1 thread "
        f"each), TinyGPT d={args.d} layers={args.layers} ({n_params / 1e6:.2f}M params), "
        f"{args.steps} steps, {machine()}"
    )
    print(
        "| mode | eager step ms | compiled step ms | eager/compiled | first step s, eager "
        "| first step s, compiled | graphs | breaks | recompiles | last loss eager / compiled |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for (z3, dedicate), rows in res.items():
        e, c = [r[False] for r in rows], [r[True] for r in rows]
        es, cs = max(r["step"] for r in e), max(r["step"] for r in c)
        print(
            f"| {'Z3' if z3 else 'Z2'}, {'dmuon_fn' if dedicate else 'FSDP2 + AdamW only'} "
            f"| {es * 1e3:.1f} | {cs * 1e3:.1f} | {es / cs:.2f}x "
            f"| {max(r['first'] for r in e):.2f} | {max(r['first'] for r in c):.1f} "
            f"| {rows[0]['graphs']} | {sum(r['breaks'] for r in rows)} "
            f"| {max(r['recompiles'] for r in rows)} | {e[0]['loss']:.5f} / {c[0]['loss']:.5f} |"
        )


if __name__ == "__main__":
    main()
