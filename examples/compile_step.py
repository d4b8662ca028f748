"""A whole distributed training step as one torch.compile(fullgraph=True) graph.

Trains examples/model.py's TinyGPT on a deterministic synthetic token stream with the functional
API (every parameter dedicated: Muon on matrices, AdamW on the rest), with a cosine learning
rate schedule passed as 0-d tensors, and prints the number of graphs, graph breaks and
recompiles. --z3 runs the step as stages (embedding, each block, head): each stage's parameters
are gathered for its forward, freed, and gathered again for its backward, so a rank holds its own
parameters and one block's copy instead of the whole model.
torchrun --nproc_per_node=4 examples/compile_step.py [--steps 30] [--z3]
"""

from __future__ import annotations

import argparse
import math
import time

import torch
import torch.nn.functional as F
from _launch import finish, init
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


def gpt_stages(model: TinyGPT) -> list:
    """TinyGPT as value_and_grad stages (names, fn(params, x, tokens) -> x; the last -> loss)."""

    def embed(p, _, tokens):
        x = F.embedding(tokens[:, :-1], p["tok.weight"])
        return x + p["pos.weight"][: tokens.shape[1] - 1]

    def block(i):
        pre = f"blocks.{i}."

        def fn(p, x, _):
            local = {n[len(pre) :]: v for n, v in p.items()}
            return torch.func.functional_call(model.blocks[i], local, (x,))

        return [pre + n for n, _ in model.blocks[i].named_parameters()], fn

    def head(p, x, tokens):
        h = F.layer_norm(x, x.shape[-1:], p["ln.weight"], p["ln.bias"])
        logits = F.linear(h, p["head.weight"])
        return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())

    return [
        (["tok.weight", "pos.weight"], embed),
        *(block(i) for i in range(len(model.blocks))),
        (["ln.weight", "ln.bias", "head.weight"], head),
    ]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--z3", action="store_true", help="gather per stage, again in backward")
    args = ap.parse_args()
    device, rank, world = init()
    mesh = init_device_mesh(device, (world,)) if world > 1 else None
    torch.manual_seed(0)
    model = TinyGPT().to(device)
    plan = dmuon_fn.plan(model, mesh)
    state = dmuon_fn.init(model, plan, dmuon_fn.Config(weight_decay=0.01))

    def loss_fn(params, batch):
        return torch.func.functional_call(model, params, (batch,))

    objective = gpt_stages(model) if args.z3 else loss_fn

    @torch.compile(fullgraph=True)
    def train_step(state, batch, lr, adamw_lr):
        loss, grads = dmuon_fn.value_and_grad(objective, plan)(state.params, batch)
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
        finish()


if __name__ == "__main__":
    main()
