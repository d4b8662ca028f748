"""A whole distributed training step as one torch.compile(fullgraph=True) graph.

Trains examples/model.py's TinyGPT on a deterministic synthetic token stream with the functional
API (every parameter dedicated: Muon on matrices, AdamW on the rest), with a cosine learning
rate schedule passed as 0-d tensors, and prints the number of graphs, graph breaks and
recompiles. torchrun --nproc_per_node=4 examples/compile_step.py [--steps 30]
"""

from __future__ import annotations

import argparse
import math
import time

import torch
import torch.distributed as dist
from _launch import init
from model import TinyGPT
from torch._dynamo.utils import counters
from torch.distributed.device_mesh import init_device_mesh

import dmuon_fn


def tokens(step: int, rank: int, batch: int = 8, seq: int = 64, vocab: int = 96) -> torch.Tensor:
    """A learnable stream: each sequence counts up from a random start with stride 1..3."""
    g = torch.Generator().manual_seed(10_000 * step + rank)
    start = torch.randint(0, vocab, (batch, 1), generator=g)
    stride = torch.randint(1, 4, (batch, 1), generator=g)
    return (start + stride * torch.arange(seq)) % vocab


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    device, rank, world = init()
    mesh = init_device_mesh(device, (world,)) if world > 1 else None
    torch.manual_seed(0)
    model = TinyGPT().to(device)
    plan = dmuon_fn.plan(model, mesh)
    state = dmuon_fn.init(model, plan, dmuon_fn.Config(weight_decay=0.01))

    def loss_fn(params, batch):
        return torch.func.functional_call(model, params, (batch,))

    @torch.compile(fullgraph=True)
    def train_step(state, batch, lr, adamw_lr):
        loss, grads = dmuon_fn.value_and_grad(loss_fn, plan)(state.params, batch)
        return loss, dmuon_fn.update(grads, state, lr=lr, adamw_lr=adamw_lr)

    counters.clear()
    t0 = time.perf_counter()
    for step in range(args.steps):
        cos = 0.5 * (1 + math.cos(math.pi * step / args.steps))
        lr = torch.tensor(0.02 * cos)
        loss, state = train_step(state, tokens(step, rank).to(device), lr, lr * 0.1)
        if step == 0:
            first = time.perf_counter() - t0
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            print(f"step {step:3d}  loss={loss.item():.4f}", flush=True)
    if rank == 0:
        graphs = counters["stats"]["unique_graphs"]
        breaks = sum(counters["graph_break"].values())
        print(
            f"graphs={graphs} graph_breaks={breaks} recompiles={graphs - 1} "
            f"first_step_s={first:.1f} (compile included)"
        )
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
