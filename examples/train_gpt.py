"""The main job: a small character-level GPT trained twice from one seed on identical batches,
dmuon_fn.Muon (dedicate_params + FSDP2) against torch.optim.AdamW (FSDP2 only).

torchrun --nproc_per_node=4 examples/train_gpt.py [--steps 300] [--out examples/results]

The text comes from examples/data/grammar.py (generated, nothing is downloaded); the last tenth
is held out for validation. Every rank reads its own slice of each global batch; the validation
loss is the mean over all ranks' slices of a fixed held-out set. Rank 0 prints the Muon run's
plan (who owns which matrix, its Newton-Schulz cost at this machine's GEMM rate), shows progress
on stderr and writes gpt_loss.png and gpt_summary.md to --out.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from _corpus import VOCAB, schedule, split, train_batch
from _launch import finish, init
from model import TinyGPT
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from tqdm import tqdm

import dmuon_fn as dmuon

COLORS = {"Muon": ("#d62728", "#780a0a"), "AdamW": ("#1f77b4", "#0a326e")}  # (train, val)

SWEEP = (
    "Learning rates, swept at the default flags (final val loss): AdamW 1e-3: 1.787, 2e-3: 1.210, "
    "3e-3: 0.917, 5e-3: 0.728, **1e-2: 0.697**, 2e-2: 0.700, 3e-2: 0.733; then Muon's matrix lr "
    "with the rest at AdamW's best 1e-2: 1e-2: 0.571, **2e-2: 0.560**, 3e-2: 0.588, 4e-2: 0.651, "
    "8e-2: 1.12 (one library revision earlier). Muon scales its lr by 0.2·sqrt(max(m, n)) "
    "(`adjust_lr='match_rms_adamw'`), so equal lrs mean about equal update sizes."
)


def progress(total: int, label: str, enabled: bool) -> tqdm:
    """A progress bar on stderr (rank 0 only): redrawn in place on a terminal, a line about
    every 10 s in a log (CI), and always the final state."""
    tty = sys.stderr.isatty()
    return tqdm(
        total=total,
        desc=f"{label:6s}",
        disable=not enabled,
        file=sys.stderr,
        ascii=not tty,
        mininterval=0.1 if tty else 10.0,
        unit="step",
    )


@dataclass
class Run:
    name: str
    lr_note: str
    train: list[float] = field(default_factory=list)  # global mean loss per step
    val: list[tuple[int, float]] = field(default_factory=list)  # (steps done, loss)
    train_s: float = 0.0  # training steps only, evaluation excluded
    wall_s: float = 0.0


@torch.no_grad()
def evaluate(model, val_rows: torch.Tensor, world: int) -> float:
    """Mean loss over every rank's rows; all ranks run the forward (FSDP2 gathers are
    collectives), each on its own equal share, then one all_reduce."""
    loss = model(val_rows).detach().float().reshape(1)
    dist.all_reduce(loss)
    return loss.item() / world


def build(args, device: str, mesh, muon: bool):
    torch.manual_seed(args.seed)
    model = TinyGPT(vocab=VOCAB, d=args.d, n_layers=args.layers, heads=args.heads, seq=args.seq)
    model = model.to(device)
    if muon:
        # the hidden matrices (attention and MLP projections); embeddings, head and norms stay
        # with FSDP2 and take AdamW
        dmuon.dedicate_params(model, mesh, predicate=lambda n, p: "proj" in n and p.ndim == 2)
        if dist.get_rank() == 0:  # the plan every rank runs, and its Newton-Schulz cost here
            rate = dmuon.measure_gemm_flops(device)
            print(dmuon.plan_summary(model, gemm_flops=rate), flush=True)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if muon:
        opt = dmuon.Muon(
            model,
            lr=args.muon_lr,
            weight_decay=args.wd,
            adamw_lr=args.adamw_lr,
            adamw_betas=(0.9, 0.95),
            adamw_weight_decay=args.wd,
        )
    else:
        opt = torch.optim.AdamW(
            model.parameters(), lr=args.adamw_lr, betas=(0.9, 0.95), weight_decay=args.wd
        )
    return model, opt


def train(args, run: Run, data, val_rows, device, mesh, rank, world) -> None:
    model, opt = build(args, device, mesh, muon=run.name == "Muon")
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule(args))
    eval_every = max(1, args.steps // args.evals)
    bar = progress(args.steps, run.name, rank == 0)
    losses = []
    t_start = time.perf_counter()
    run.val.append((0, evaluate(model, val_rows, world)))
    for step in range(args.steps):
        t0 = time.perf_counter()
        x = train_batch(data, step, args, rank, world).to(device)
        opt.zero_grad()
        loss = model(x)
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.detach().float())
        run.train_s += time.perf_counter() - t0
        tok_s = (step + 1) * args.batch * args.seq / run.train_s
        if rank == 0:
            postfix = {"loss": f"{losses[-1].item():.3f}", "tok_s": f"{tok_s / 1000:.1f}k"}
            bar.set_postfix(postfix, refresh=False)  # drawn at the bar's own pace
        bar.update(1)
        if (step + 1) % eval_every == 0 or step + 1 == args.steps:
            run.val.append((step + 1, evaluate(model, val_rows, world)))
    bar.close()
    mean = torch.stack(losses).to(device)
    dist.all_reduce(mean)  # one collective for the whole curve, not one per step
    run.train = (mean / world).tolist()
    run.wall_s = time.perf_counter() - t_start


def first_reaching(curve: list[float], target: float, window: int) -> int | None:
    """The first step whose trailing `window`-step mean is at or below `target`."""
    for i in range(window, len(curve) + 1):
        if sum(curve[i - window : i]) / window <= target:
            return i
    return None


def summarize(args, runs: list[Run], world: int) -> str:
    w = min(10, args.steps)
    tokens = args.steps * args.batch * args.seq
    rows = [
        "| optimizer | lr (matrices / rest) | steps | tokens | train loss (last "
        f"{w} steps) | val loss | wall s | ms/step |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        rows.append(
            f"| {r.name} | {r.lr_note} | {args.steps} | {tokens:,} | "
            f"{sum(r.train[-w:]) / w:.4f} | {r.val[-1][1]:.4f} | {r.wall_s:.1f} | "
            f"{1000 * r.train_s / args.steps:.0f} |"
        )
    muon, adamw = runs
    dv = adamw.val[-1][1] - muon.val[-1][1]
    dt = sum(adamw.train[-w:]) / w - sum(muon.train[-w:]) / w
    target = sum(adamw.train[-w:]) / w
    reach = first_reaching(muon.train, target, w)
    by_eval = ", ".join(
        f"{s}: {a - m:+.3f}" for (s, m), (_, a) in zip(muon.val, adamw.val, strict=True)
    )
    lines = [
        f"Muon advantage at equal steps ({args.steps}): val loss {dv:+.4f} nats/char "
        f"({100 * dv / adamw.val[-1][1]:+.1f}%), train loss {dt:+.4f} "
        "(positive = Muon lower).",
        f"AdamW val loss minus Muon val loss at each evaluation (step: difference): {by_eval}.",
        f"Muon reaches AdamW's final train loss {target:.4f} at step "
        + (
            f"{reach} of {args.steps}, after about {reach * muon.train_s / args.steps:.0f} s "
            f"of training steps (AdamW: {adamw.train_s:.0f} s for all {args.steps})."
            if reach
            else "- (never within the run)."
        ),
    ]
    argv = " ".join(sys.argv[1:])
    command = f"torchrun --nproc_per_node={world} examples/train_gpt.py {argv}".strip()
    header = (
        "# TinyGPT, character level: Muon (dmuon_fn) vs AdamW\n\n"
        f"`{command}`: d={args.d}, {args.layers} layers, {args.heads} heads, context {args.seq}, "
        f"vocab {VOCAB}, global batch {args.batch} sequences ({args.batch // world} per rank), "
        f"{world} ranks, seed {args.seed}; both runs start from the same weights and see the "
        f"same batches in the same order. Schedule: linear warmup over {args.warmup:.0%} of the "
        f"steps, cosine decay to 0.1x; weight decay {args.wd}; AdamW betas (0.9, 0.95) in both "
        "runs (Muon's AdamW covers embeddings, head and norms). Losses are nats per character "
        f"(uniform guess: ln {VOCAB} = {math.log(VOCAB):.2f}). wall s includes the evaluations, "
        "ms/step does not; both are wall-clock, so other load on the machine moves them.\n\n"
        f"{SWEEP}\n"
    )
    return header + "\n" + "\n".join(rows) + "\n\n" + "\n".join(lines) + "\n"


def plot(runs: list[Run], args, world: int, path: str) -> None:
    """Train (per step) and validation (per evaluation) loss of both runs, 800×500 pixels."""
    import matplotlib

    matplotlib.use("Agg")  # no display: write the file only
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5), dpi=100)
    for r in runs:
        train, val = COLORS[r.name]
        ax.plot(range(1, args.steps + 1), r.train, color=train, lw=1, label=f"{r.name} train")
        xs, ys = zip(*r.val, strict=True)
        ax.plot(xs, ys, "o-", color=val, ms=4, label=f"{r.name} val")
    ax.set(title=f"TinyGPT, {world} ranks: Muon vs AdamW", xlabel="step", ylabel="loss (nats/char)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.savefig(path)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--quick", action="store_true", help="20 steps, a smoke test")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--batch", type=int, default=32, help="global batch, in sequences")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--muon-lr", type=float, default=0.02)
    ap.add_argument("--adamw-lr", type=float, default=1e-2, help="AdamW's, and Muon's rest")
    ap.add_argument("--wd", type=float, default=0.01)
    ap.add_argument("--warmup", type=float, default=0.05, help="fraction of the steps")
    ap.add_argument("--evals", type=int, default=10, help="validation points after step 0")
    ap.add_argument("--val-rows", type=int, default=64, help="held-out sequences, all ranks")
    ap.add_argument("--chars", type=int, default=600_000, help="corpus size")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", choices=["Muon", "AdamW"], help="one run, for lr sweeps")
    args = ap.parse_args()
    if args.quick:
        args.steps, args.evals = 20, 2

    device, rank, world = init()
    train_data, val_data, val_rows = split(args, rank, world, device)
    mesh = init_device_mesh(device, (world,))
    if rank == 0:
        chars = f"{len(train_data):,} train / {len(val_data):,} val characters"
        print(f"corpus: {chars}; {dmuon.get_ns_backend()}", flush=True)

    runs = [
        Run("Muon", f"{args.muon_lr:g} / {args.adamw_lr:g}"),
        Run("AdamW", f"{args.adamw_lr:g} / {args.adamw_lr:g}"),
    ]
    runs = [r for r in runs if args.only in (None, r.name)]
    for run in runs:
        train(args, run, train_data, val_rows, device, mesh, rank, world)
        if rank == 0:
            print(f"{run.name}: final val loss {run.val[-1][1]:.4f}", flush=True)

    if rank == 0 and args.only is None:
        table = summarize(args, runs, world)
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "gpt_summary.md"), "w") as f:
            f.write(table)
        plot(runs, args, world, os.path.join(args.out, "gpt_loss.png"))
        print(table, flush=True)
    finish()


if __name__ == "__main__":
    main()
