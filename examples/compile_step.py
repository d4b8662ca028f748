"""A whole distributed training step as one torch.compile(fullgraph=True) graph.

Trains examples/model.py's TinyGPT on a deterministic synthetic token stream with the functional
API (every parameter dedicated: Muon on matrices, AdamW on the rest), with a cosine learning
rate schedule passed as 0-d tensors, and prints the number of graphs, graph breaks and
recompiles. --z3 runs the step as stages (embedding, each block, head): each stage's parameters
are gathered for its forward, freed, and gathered again for its backward, so a rank holds its own
parameters and one block's copy instead of the whole model. --bf16: mixed precision
(`plan(param_dtype=torch.bfloat16)`): the global owners keep fp32 masters and fp32 optimizer
state, every gather broadcasts the bf16 copy and the model computes in bf16, gradients are
summed in bf16. At the end it prints the median step time and, the largest over ranks, the
bytes a rank holds between steps (its parameters and optimizer state) and the peak bytes the
step allocates (all of it, and the gathered copies alone; examples/benchmarks/_memory.py).
torchrun --nproc_per_node=4 examples/compile_step.py [--steps 30] [--z3] [--bf16]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _launch import finish, init
from model import TinyGPT
from torch._dynamo.utils import counters
from torch.distributed.device_mesh import init_device_mesh

import dmuon_fn

sys.path.insert(0, str(Path(__file__).resolve().parent / "benchmarks"))
from _memory import peak_bytes


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
    ap.add_argument("--bf16", action="store_true", help="bf16 compute, fp32 masters and state")
    args = ap.parse_args()
    device, rank, world = init()
    mesh = init_device_mesh(device, (world,)) if world > 1 else None
    torch.manual_seed(0)
    model = TinyGPT().to(device)
    plan = dmuon_fn.plan(model, mesh, param_dtype=torch.bfloat16 if args.bf16 else None)
    state = dmuon_fn.init(model, plan, dmuon_fn.Config(weight_decay=0.01))

    def loss_fn(params, batch):
        return torch.func.functional_call(model, params, (batch,))

    objective = gpt_stages(model) if args.z3 else loss_fn

    @torch.compile(fullgraph=True)
    def train_step(state, batch, lr, adamw_lr):
        loss, grads = dmuon_fn.value_and_grad(objective, plan)(state.params, batch)
        return loss, dmuon_fn.update(grads, state, lr=lr, adamw_lr=adamw_lr)

    def args_at(step):
        cos = 0.5 * (1 + math.cos(math.pi * step / args.steps))
        lr = torch.tensor(0.02 * cos)
        return tokens(step, rank).to(device), lr, lr * 0.1

    counters.clear()
    times = []
    for step in range(args.steps):
        t0 = time.perf_counter()
        loss, state = train_step(state, *args_at(step))
        loss = loss.item()  # waits for the step
        times.append(time.perf_counter() - t0)
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            print(f"step {step:3d}  loss={loss:.4f}", flush=True)
    # one more step under the allocator's records (slower: not timed)
    (_, state), peak = peak_bytes(lambda: train_step(state, *args_at(args.steps)))
    held = sum(t.numel() * t.element_size() for t in _tensors(state))
    mb = torch.tensor([held, peak["total"], peak["gathered"]], dtype=torch.float64) / 2**20
    if world > 1:
        dist.all_reduce(mb, op=dist.ReduceOp.MAX)
    if rank == 0:
        graphs = counters["stats"]["unique_graphs"]
        breaks = sum(counters["graph_break"].values())
        print(
            f"graphs={graphs} graph_breaks={breaks} recompiles={graphs - 1} "
            f"first_step_s={times[0]:.1f} (compile included)"
        )
        print(
            f"{'bf16 compute, fp32 masters' if args.bf16 else 'fp32'}: "
            f"step_ms={1e3 * statistics.median(times[1:]):.1f} (median after the first) "
            f"held_MB={mb[0]:.2f} step_peak_MB={mb[1]:.2f} gathered_peak_MB={mb[2]:.2f} "
            "(largest rank)"
        )
    if world > 1:
        finish()


def _tensors(state: dmuon_fn.State) -> list[torch.Tensor]:
    """Every tensor a rank holds between steps: parameters, optimizer state, counters."""
    opt = [t for s in state.opt.values() for t in s]
    return [*state.params.values(), *opt, state.skipped_steps, state.grad_norm]


if __name__ == "__main__":
    main()
