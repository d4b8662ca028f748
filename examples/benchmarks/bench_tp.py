"""Tensor parallelism: FSDP2 + TP + AdamW vs dmuon_fn with TP (dedicated Muon), side by side.

W = 4 CPU ranks (gloo, one thread each) on a (dp 2, tp 2) mesh train a stack of transformer
blocks, every block tensor parallel (ColwiseParallel q/k/v/up, RowwiseParallel o/down):

- "FSDP2 + TP + AdamW Z2" / "Z3": parallelize_module, then fully_shard over the data mesh (per
  block and the root; reshard_after_forward False / True), AdamW on the local shards;
- "dmuon TP Z2" / "Z3": parallelize_module, dedicate_params over the data mesh (the matrices),
  fully_shard the rest (the norms), Muon: each matrix's tensor-parallel parts are dedicated
  over the data ranks, and the step orthogonalizes it once, on one tensor rank of its owner
  (dmuon_fn/tp/_layout.py).

Configurations are built at once and step round-robin (drift hits all alike). Per
configuration, medians over the timed steps of forward+backward seconds (until the gradients
have landed), step seconds and the whole iteration; then one counted step: bytes per rank per
step by phase (`CommCounter`, (W−1)/W convention; a point-to-point transfer of N bytes books N/2
on each end; the tensor-parallel layers' own activation collectives in a column of their own)
beside the formula for the matrices (N elements each, G data ranks, T tensor
ranks, parts of N/T, fp32):

    FSDP2 + TP + AdamW   forward all-gather (G−1)/G·N/T, backward reduce-scatter (G−1)/G·N/T,
                         Z3 (reshard_after_forward) another all-gather in backward: per rank
                         (2 or 3)·(G−1)/G·4N/T
    dmuon_fn with TP     the same in forward+backward (broadcast and reduce of each part over
                         its data ranks), plus in the step, per matrix, the root's gather of
                         the other parts of u and scatter of O's: 2·(T−1)/T·4N over the job,
                         averaged over its G·T ranks

Run: python examples/benchmarks/bench_tp.py [--d 384 --layers 4 --tokens 256]
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch
import torch.distributed as dist
from _timing import counted_step, machine, run_ranks
from bench_overlap import Stack
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import dmuon_fn as dmuon

SHAPE = (2, 2)  # (dp, tp)
CONFIGS = ["FSDP2 + TP + AdamW Z2", "dmuon TP Z2", "FSDP2 + TP + AdamW Z3", "dmuon TP Z3"]


def _tp_plan() -> dict:
    col, row = ColwiseParallel(), RowwiseParallel()
    return {"q_proj": col, "k_proj": col, "v_proj": col, "up_proj": col, "o_proj": row,
            "down_proj": row}  # fmt: skip


def _build(config: str, args, mesh):
    model = Stack(args.d, args.heads, args.layers)
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], _tp_plan())
    z3 = "Z3" in config
    if config.startswith("dmuon"):
        dmuon.dedicate_params(
            model, mesh["dp"], lambda n, p: "proj" in n and p.ndim == 2, reshard_after_forward=z3
        )
    for block in model.blocks:
        fully_shard(block, mesh=mesh["dp"], reshard_after_forward=z3)
    fully_shard(model, mesh=mesh["dp"])
    if config.startswith("dmuon"):
        return model, dmuon.Muon(model, lr=0.01, adamw_lr=1e-4)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def _step(model, opt, x) -> tuple[float, float]:
    dist.barrier()
    t0 = time.perf_counter()
    model(x).backward()
    if isinstance(opt, dmuon.Muon):
        dmuon.wait_gradients(model)
    t1 = time.perf_counter()
    opt.step()
    opt.zero_grad()
    if isinstance(opt, dmuon.Muon):
        opt.wait_publish()
    dist.barrier()
    return t1 - t0, time.perf_counter() - t1


def _counted(model, opt, x) -> dict:
    comm = counted_step(model, opt, x)
    out = {}
    for ph in ("fwd+bwd", "step"):
        ops = comm.stats[ph].op_bytes
        # tensor parallelism's own activation collectives (DTensor runs them as functional
        # collectives) apart from the data-parallel and optimizer traffic (c10d ops)
        out[f"{ph} tp"] = sum(b for op, b in ops.items() if op in _ACTIVATION_OPS)
        out[ph] = sum(b for op, b in ops.items() if op not in _ACTIVATION_OPS)
    return out


_ACTIVATION_OPS = {"all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast"}


def _formula(model, z3: bool, dedicated: bool) -> dict:
    """Per rank per step, the matrices' bytes by the formula in the module docstring."""
    G, T = SHAPE
    W = G * T
    fb = step = 0.0
    for n, p in model.named_parameters():
        if "proj" not in n or p.ndim != 2:
            continue
        N = math.prod(p.shape)  # the whole matrix
        fb += (3 if z3 else 2) * (G - 1) / G * 4 * N / T
        if dedicated:
            step += 2 * (T - 1) / T * 4 * N / W
    return {"fwd+bwd": fb, "step": step}


def _ns_alone(model, opt, reps: int = 3) -> float:
    """The step's floor: the Newton-Schulz runs this rank makes in a step (the matrices it is
    the root of), with no exchange, all ranks at once; the slowest rank's seconds, median."""
    st = model._dmuon_state
    mine = [
        torch.randn(e.full_shape, generator=torch.Generator().manual_seed(i))
        for i, e in enumerate(st.entries)
        if e.is_matrix and st.is_global_owner(e) and e.tp.root == st.tensor.rank
    ]
    times = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        for x in mine:
            dmuon.orthogonalize(x, steps=opt.ns.steps)
        dt = torch.tensor(time.perf_counter() - t0)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        times.append(dt.item())
    return statistics.median(times)


def rank_main(rank: int, world: int, args) -> dict:
    mesh = init_device_mesh("cpu", SHAPE, mesh_dim_names=("dp", "tp"))
    data_rank = rank // SHAPE[1]
    gen = torch.Generator().manual_seed(data_rank)
    x = torch.randn(1, args.tokens, args.d, generator=gen)
    runs = {c: _build(c, args, mesh) for c in CONFIGS}
    times = {c: ([], []) for c in CONFIGS}
    for i in range(args.warmup + args.steps):
        for config, (model, opt) in runs.items():
            fb, st = _step(model, opt, x)
            if i >= args.warmup:
                times[config][0].append(fb)
                times[config][1].append(st)
    out = {}
    whole = Stack(args.d, args.heads, args.layers)  # shapes for the formula
    for config, (model, opt) in runs.items():
        fb, st = times[config]
        out[config] = dict(
            fb=statistics.median(fb),
            step=statistics.median(st),
            it=statistics.median(a + b for a, b in zip(fb, st, strict=True)),
            bytes=_counted(model, opt, x),
            formula=_formula(whole, "Z3" in config, config.startswith("dmuon")),
            ns_calls=getattr(opt, "ns_calls", 0),
        )
    out["ns alone"] = _ns_alone(*runs["dmuon TP Z2"])
    ns = torch.tensor([out[c]["ns_calls"] for c in CONFIGS])
    dist.all_reduce(ns)
    for c, n in zip(CONFIGS, ns.tolist(), strict=True):
        out[c]["ns_total"] = n
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--d", type=int, default=384)
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=256, help="per data rank")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args()
    G, T = SHAPE
    print(f"# tensor parallel, (dp {G}, tp {T}) = {G * T} CPU ranks (gloo), {machine()}")
    print(
        f"# {args.layers} blocks d={args.d}, every block tensor parallel, {args.tokens} tokens "
        f"per data rank, median of {args.steps} steps after {args.warmup}; "
        f"{dmuon.get_ns_backend('cpu')}"
    )
    res = run_ranks(rank_main, G * T, args)
    print(
        "\n| configuration | fwd+bwd s | step s | iteration s | vs FSDP2 + TP + AdamW "
        "| MB/rank/step fwd+bwd counted (formula) | step counted (formula) "
        "| TP activations fwd+bwd |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for c in CONFIGS:
        r, base = res[c], res[f"FSDP2 + TP + AdamW {c[-2:]}"]
        b, f = r["bytes"], r["formula"]
        print(
            f"| {c} | {r['fb']:.3f} | {r['step']:.3f} | {r['it']:.3f} "
            f"| {r['it'] / base['it']:.2f}x | {b['fwd+bwd'] / 2**20:.2f} "
            f"({f['fwd+bwd'] / 2**20:.2f}) | {b['step'] / 2**20:.3f} ({f['step'] / 2**20:.3f}) "
            f"| {b['fwd+bwd tp'] / 2**20:.2f} |"
        )
    print(
        f"\nstep floor (each rank's own Newton-Schulz runs alone, slowest rank): "
        f"{res['ns alone']:.3f} s; dmuon TP step / floor: Z2 "
        f"{res['dmuon TP Z2']['step'] / res['ns alone']:.2f}x, Z3 "
        f"{res['dmuon TP Z3']['step'] / res['ns alone']:.2f}x"
    )
    steps = args.steps + args.warmup + 1
    for c in CONFIGS[1::2]:
        n_mat = 6 * args.layers
        print(f"\n{c}: Newton-Schulz runs in the job {res[c]['ns_total']} = {steps} steps x "
              f"{n_mat} matrices ({steps * n_mat})")  # fmt: skip
    print(
        "\n(counted: every c10d collective, data parallel and the step's; the norms' FSDP2 "
        "traffic and the 16-byte gradient-norm all-reduce are in it, not in the formula. "
        "TP activations: the tensor-parallel layers' own collectives, the same for all)"
    )


if __name__ == "__main__":
    main()
