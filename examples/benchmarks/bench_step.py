"""The main job's training step by phase: Muon (dmuon_fn) vs FSDP2 + AdamW, W CPU ranks (gloo).

The model and optimizers are examples/train_gpt.py's `build`: TinyGPT (examples/model.py, d=128,
2 layers, 4 heads, context 64), global batch 32 of examples/_corpus.py's `train_batch`; for Muon
the projections are dedicated (`dedicate_params`, Z3, prefetch 1) and the rest `fully_shard`ed
per block + root, `dmuon_fn.Muon(lr=0.02, weight_decay=0.01, adamw_lr=1e-2, adamw_betas=(0.9,
0.95))`; for AdamW everything is `fully_shard`ed, `torch.optim.AdamW` with the same settings.
A third row is Muon with `nonfinite="ignore"` (no gradient guard: what the guard costs).

All three are built in one process per rank and stepped round-robin (the order rotating every
step) on identical batches, so drift in the machine's speed hits them alike. Each step starts
after a barrier; its phases, timed around the real calls: forward (`model(x)`), backward
(`loss.backward()`), gradient wait (`dmuon_fn.wait_gradients`, called before `opt.step()`: the
dedicated reduces still in flight when backward returns; FSDP2's reduce-scatters finish inside
backward, so AdamW has nothing to wait for: "-"), guard (`opt.guard.check`, the global-norm
all-reduce and skip mask, timed by a wrapper set here) and update (the rest of `opt.step()`).
Newton-Schulz: the seconds inside the step's calls of `orthogonalize_with`/`orthogonalize_blocks`
(wrapped here), on the matrices this rank owns; part of update. `zero_grad` is not timed. Every
time is the median over --steps timed steps after --warmup; "r0 / max": rank 0's median, then the
largest of the ranks' medians. Collectives and bytes per rank per step: `CommCounter` over one
more step per optimizer, not timed (the dispatch mode slows every op); dmuon_fn's direct-transfer
reduces are send/recv pairs it books as `reduce_`.

Run: python examples/benchmarks/bench_step.py [--world 4] [--steps 20]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import Counter

import torch
import torch.distributed as dist
from _timing import counted_step, machine, run_ranks
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import dmuon_fn as dmuon
from dmuon_fn.optim import _update

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
CONFIGS = ("Muon", "Muon, nonfinite=ignore", "FSDP2 + AdamW")
PHASES = ("total", "forward", "backward", "wait", "guard", "update", "ns")
CLOCK = {"guard": 0.0, "ns": 0.0}  # seconds inside the wrapped calls during this step


def _timed(fn, key: str):
    def wrapped(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            CLOCK[key] += time.perf_counter() - t0

    return wrapped


def _build(config: str, args, mesh):
    from _corpus import VOCAB
    from model import TinyGPT

    torch.manual_seed(args.seed)
    model = TinyGPT(vocab=VOCAB, d=args.d, n_layers=args.layers, heads=args.heads, seq=args.seq)
    muon = config.startswith("Muon")
    if muon:
        dmuon.dedicate_params(model, mesh, predicate=lambda n, p: "proj" in n and p.ndim == 2)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if not muon:
        hyper = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.01)
        return model, torch.optim.AdamW(model.parameters(), **hyper)
    nonfinite = "ignore" if "ignore" in config else "skip"
    opt = dmuon.Muon(model, lr=0.02, weight_decay=0.01, adamw_lr=1e-2, adamw_betas=(0.9, 0.95),
                     adamw_weight_decay=0.01, nonfinite=nonfinite)  # fmt: skip
    opt.guard.check = _timed(opt.guard.check, "guard")
    return model, opt


def _step(model, opt, x) -> dict[str, float]:
    muon = isinstance(opt, dmuon.Muon)
    dist.barrier()  # every rank starts the step together
    CLOCK.update(guard=0.0, ns=0.0)
    t0 = time.perf_counter()
    loss = model(x)
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    if muon:
        dmuon.wait_gradients(model)
    t3 = time.perf_counter()
    opt.step()
    t4 = time.perf_counter()
    opt.zero_grad()
    return dict(total=t4 - t0, forward=t1 - t0, backward=t2 - t1, wait=t3 - t2,
                guard=CLOCK["guard"], update=t4 - t3 - CLOCK["guard"], ns=CLOCK["ns"])  # fmt: skip


def _counted(model, opt, x) -> dict:
    """One more step under `CommCounter`: calls by kind and bytes per rank, all and in step()."""
    dist.barrier()
    comm = counted_step(model, opt, x)
    calls = Counter()
    for st in comm.stats.values():
        calls.update(st.calls)
    step = comm.stats["step"]
    return dict(calls=dict(calls), bytes=comm.total_bytes(), step_calls=sum(step.calls.values()),
                step_bytes=step.bytes)  # fmt: skip


def _rank(rank: int, world: int, args) -> list[dict]:
    from _corpus import encode, train_batch
    from data.grammar import corpus

    # Newton-Schulz as the step calls it (module globals, looked up at call time)
    _update.orthogonalize_with = _timed(_update.orthogonalize_with, "ns")
    _update.orthogonalize_blocks = _timed(_update.orthogonalize_blocks, "ns")
    mesh = init_device_mesh("cpu", (world,))
    data = encode(corpus(args.chars, seed=args.seed))
    runs = {c: _build(c, args, mesh) for c in CONFIGS}
    times = {c: {k: [] for k in PHASES} for c in CONFIGS}
    for i in range(args.warmup + args.steps):
        x = train_batch(data, i, args, rank, world)  # the same batch for every optimizer
        order = CONFIGS[i % len(CONFIGS) :] + CONFIGS[: i % len(CONFIGS)]
        for config in order:
            t = _step(*runs[config], x)
            for k, v in t.items():
                if i >= args.warmup:
                    times[config][k].append(v)
    x = train_batch(data, args.warmup + args.steps, args, rank, world)
    out = {
        c: {**{k: statistics.median(v) for k, v in times[c].items()}, **_counted(*runs[c], x)}
        for c in CONFIGS
    }
    every: list = [None] * world
    dist.all_gather_object(every, out)
    return every


def _ms(ranks: list[dict], config: str, key: str) -> tuple[float, float]:
    vals = [r[config][key] * 1e3 for r in ranks]
    return vals[0], max(vals)


def report(args, ranks: list[dict], argv: list[str]) -> str:
    W = args.world
    head = [
        f"# main job's step by phase, Muon (dmuon_fn) vs FSDP2 + AdamW, W={W} CPU ranks (gloo, "
        f"1 thread each, on {os.cpu_count()} cores), {machine()}",
        f"# `{' '.join(['python examples/benchmarks/bench_step.py', *argv])}`",
        f"# TinyGPT d={args.d}, {args.layers} layers, {args.heads} heads, context {args.seq}, "
        f"global batch {args.batch} ({args.batch // W} per rank); median of {args.steps} steps "
        f"after {args.warmup}, round-robin, identical batches; {dmuon.get_ns_backend('cpu')}",
        "",
        "ms, rank 0 / max over ranks of the medians:",
        "",
        "| optimizer | ms/step | forward | backward | gradient wait | guard | update "
        "| of which Newton-Schulz |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c in CONFIGS:
        cells = []
        for k in PHASES:
            r0, mx = _ms(ranks, c, k)
            none = c.startswith("FSDP2") and k in ("wait", "guard", "ns")
            cells.append("-" if none else f"{r0:.1f} / {mx:.1f}")
        head.append(f"| {c} | {' | '.join(cells)} |")
    head += [
        "",
        "Collectives per step (rank 0's calls by kind; CommCounter, one extra step), bytes per "
        "rank per step (rank 0 / max over ranks):",
        "",
        "| optimizer | calls | by kind | in step() | KiB/rank/step | in step() bytes |",
        "|---|---|---|---|---|---|",
    ]
    for c in CONFIGS:
        r = ranks[0][c]
        kinds = ", ".join(f"{k} {n}" for k, n in sorted(r["calls"].items()))
        kib = [x[c]["bytes"] / 1024 for x in ranks]
        sb = [x[c]["step_bytes"] for x in ranks]
        head.append(
            f"| {c} | {sum(r['calls'].values())} | {kinds} | {r['step_calls']} "
            f"| {kib[0]:.1f} / {max(kib):.1f} | {sb[0]:.0f} / {max(sb):.0f} |"
        )
    m, a = "Muon", "FSDP2 + AdamW"
    (m0, mx), (a0, ax) = _ms(ranks, m, "total"), _ms(ranks, a, "total")
    mc, ac = sum(ranks[0][m]["calls"].values()), sum(ranks[0][a]["calls"].values())
    mb, ab = ranks[0][m]["bytes"], ranks[0][a]["bytes"]
    head += [
        "",
        f"Muon / AdamW: ms/step {m0 / a0:.2f}x (rank 0), {mx / ax:.2f}x (max over ranks); "
        f"collectives {mc / ac:.2f}x; bytes per rank {mb / ab:.2f}x (rank 0).",
    ]
    # per rank: Muon's step (wait + guard + update) against AdamW's step + Newton-Schulz + 2 ms
    rows = []
    for r in ranks:
        step = sum(r[m][k] for k in ("wait", "guard", "update")) * 1e3
        bound = (r[a]["update"] + r[m]["ns"]) * 1e3 + 2.0
        rows.append((step - bound, step, r[a]["update"] * 1e3, r[m]["ns"] * 1e3))
    for label, (over, step, adam, ns) in (("rank 0", rows[0]), ("worst rank", max(rows))):
        head.append(
            f"Step phase vs AdamW step + Newton-Schulz + 2 ms, {label}: Muon {step:.1f} ms "
            f"(gradient wait + guard + update) vs {adam:.1f} + {ns:.1f} + 2 = "
            f"{adam + ns + 2:.1f} ms: {'within' if over <= 0 else 'over'} by {abs(over):.1f} ms."
        )
    head.append(
        "Newton-Schulz: measured inside the step (wrapped orthogonalize calls on the rank's own "
        "matrices); nonfinite=ignore's row shows Muon without the guard's all-reduce."
    )
    return "\n".join(head)


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=32, help="global batch, in sequences")
    ap.add_argument("--chars", type=int, default=200_000, help="corpus size")
    ap.add_argument("--seed", type=int, default=0)
    argv = sys.argv[1:] if argv is None else argv
    args = ap.parse_args(argv)
    if args.batch % args.world:
        ap.error(f"--batch {args.batch} must be a multiple of --world {args.world}")
    text = report(args, run_ranks(_rank, args.world, args), argv)
    print(text, flush=True)
    return text


if __name__ == "__main__":
    main()
