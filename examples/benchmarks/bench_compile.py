"""Eager vs torch.compile(fullgraph=True) functional training step, Z2 vs Z3, on W CPU ranks.

examples/model.py's TinyGPT, every parameter dedicated (Muon on matrices, AdamW on the rest).
Z2: value_and_grad(loss_fn) gathers every parameter for the whole step. Z3: value_and_grad over
stages (embedding, each block, head; examples/compile_step.gpt_stages) gathers each stage for
its forward and again for its backward. For each mode: median step time, the first step's time
(compile included), and per rank the peak parameter memory — its own parameters plus the peak
of live gathered copies over one step, from the CPU allocator's records (_memory.py) — next to
total / W + the largest stage (the Z3 target's base) and a full replica (every rank holding the
whole model, trained with plain AdamW), plus the peak of all tensors allocated during the step.
Graphs / graph breaks / recompiles are counted over the run (a cosine lr schedule).
Run: python examples/benchmarks/bench_compile.py [--world 4]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from _timing import machine, run_ranks
from torch._dynamo.utils import counters
from torch.distributed.device_mesh import init_device_mesh

import dmuon_fn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from _memory import peak_bytes
from compile_step import gpt_stages, tokens
from model import TinyGPT


def _rank(rank, world, mode, args):
    torch.manual_seed(0)
    model = TinyGPT(d=args.d, n_layers=args.layers)
    n_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    if mode == "replica":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

        def step_fn(step):
            opt.zero_grad()
            model(tokens(step, rank)).backward()
            opt.step()

        local = n_bytes
    else:
        mesh = init_device_mesh("cpu", (world,))
        fn_plan = dmuon_fn.plan(model, mesh)
        holder = [dmuon_fn.init(model, fn_plan)]
        local = sum(t.numel() * t.element_size() for t in holder[0].params.values())

        def loss_fn(params, batch):
            return torch.func.functional_call(model, params, (batch,))

        objective = gpt_stages(model) if mode.startswith("z3") else loss_fn

        def fn(state, batch, lr):
            loss, grads = dmuon_fn.value_and_grad(objective, fn_plan)(state.params, batch)
            return loss, dmuon_fn.update(grads, state, lr=lr, adamw_lr=lr * 0.1)

        if mode.endswith("compiled"):
            counters.clear()
            fn = torch.compile(fn, fullgraph=True)

        def step_fn(step):
            lr = torch.tensor(0.02 * 0.5 * (1 + math.cos(math.pi * step / args.steps)))
            _, holder[0] = fn(holder[0], tokens(step, rank), lr)

    times = []
    for step in range(args.steps):
        dist.barrier()
        t0 = time.perf_counter()
        step_fn(step)
        times.append(time.perf_counter() - t0)
    dist.barrier()
    _, mem = peak_bytes(lambda: step_fn(args.steps - 1))  # one more step, warm, profiled
    out = dict(
        step=statistics.median(times[2:]),
        first=times[0],
        param=local + mem["gathered"],
        alloc=mem["total"],
        total=n_bytes,
    )
    if mode.endswith("compiled"):
        out.update(
            graphs=counters["stats"]["unique_graphs"], breaks=sum(counters["graph_break"].values())
        )
    gathered = [None] * world
    dist.all_gather_object(gathered, out)
    return gathered


MODES = {
    "z2_eager": "Z2 functional, eager",
    "z2_compiled": "Z2 functional, torch.compile fullgraph",
    "z3_eager": "Z3 functional (stages), eager",
    "z3_compiled": "Z3 functional (stages), torch.compile fullgraph",
    "replica": "full replica + AdamW (memory reference)",
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    args = ap.parse_args()
    res = {m: run_ranks(_rank, args.world, m, args) for m in MODES}
    model = TinyGPT(d=args.d, n_layers=args.layers)
    n_params = sum(p.numel() for p in model.parameters())
    sizes = {n: p.numel() * p.element_size() for n, p in model.named_parameters()}
    stage = max(sum(sizes[n] for n in names) for names, _ in gpt_stages(model))
    target = sum(sizes.values()) / args.world + stage
    mib = 2.0**20
    print(
        f"# compiled functional step, W={args.world} CPU ranks (gloo, 1 thread each), TinyGPT "
        f"d={args.d} layers={args.layers} ({n_params / 1e6:.2f}M params, fp32), {machine()}"
    )
    print(
        f"# total / W + largest stage = {target / mib:.2f} MiB "
        f"(largest stage: one block, {stage / mib:.2f} MiB)"
    )
    print(
        "| mode | median step ms (max rank) | first step s | peak param MiB (max rank) "
        "| / (total/W + stage) | peak step allocations MiB (max rank) |"
    )
    print("|---|---|---|---|---|---|")
    for m, rows in res.items():
        param = max(r["param"] for r in rows)
        print(
            f"| {MODES[m]} | {max(r['step'] for r in rows) * 1e3:.1f} "
            f"| {max(r['first'] for r in rows):.1f} | {param / mib:.2f} | {param / target:.2f}x "
            f"| {max(r['alloc'] for r in rows) / mib:.2f} |"
        )
    print()
    for z in ("z2", "z3"):
        c = res[f"{z}_compiled"][0]
        ratio = max(r["step"] for r in res[f"{z}_eager"]) / max(
            r["step"] for r in res[f"{z}_compiled"]
        )
        print(
            f"{z.upper()}: eager/compiled step time {ratio:.2f}x; graphs={c['graphs']} "
            f"graph_breaks={c['breaks']} recompiles={c['graphs'] - 1} over {args.steps + 1} "
            "steps with a cosine lr schedule"
        )


if __name__ == "__main__":
    main()
