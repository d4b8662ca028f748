"""A layer's dedicated traffic on gloo, side by side: the ways to move W tensors of different
sizes, tensor i owned by rank i (the main job's layer: 48, 16, 64 and 64 Ki fp32 elements).

Sums onto the owners: gloo's `reduce` per tensor (what `dist.reduce` does), dmuon_fn's direct
transfers per tensor (`custom_ops._collectives.reduce_start` below DIRECT_MAX: every rank sends
to the owner, which adds), gloo's `gather` per tensor (then a sum), and one uneven
`reduce_scatter` for the layer. Copies from the owners: gloo's `broadcast` per tensor, direct
sends per tensor (the root sends to each rank), one `all_to_all_single` for the layer (the
owner's tensor repeated W times as its input), one padded `all_gather_into_tensor`. Each is
issued for all W tensors, then waited for; after a barrier, round-robin; medians of --reps,
rank 0's.

Run: python examples/benchmarks/bench_collectives.py [--world 4] [--reps 30]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
from _timing import machine, run_ranks

from custom_ops._collectives import reduce_start

SIZES = (49152, 16384, 65536, 65536)  # TinyGPT d=128: qkv, proj, fc1, fc2


def _rank(rank: int, world: int, reps: int) -> dict[str, float]:
    torch.set_num_threads(1)
    sizes = [SIZES[i % len(SIZES)] for i in range(world)]
    bufs = [torch.randn(s) for s in sizes]
    inbox = [
        [torch.empty(s) for _ in range(world)] if rank == i else None for i, s in enumerate(sizes)
    ]
    out, wide = torch.empty(sizes[rank]), max(sizes)
    padded, gathered = torch.zeros(wide), torch.empty(world * wide)

    def waited(works):
        for w in works:
            w.wait()

    def direct_broadcasts():
        works = []
        for i, b in enumerate(bufs):
            if rank == i:
                works += [dist.isend(b, dst=j, tag=7) for j in range(world) if j != i]
            else:
                works.append(dist.irecv(b, src=i, tag=7))
        waited(works)

    def all_to_all():
        got = torch.empty(sum(sizes))
        mine = bufs[rank].repeat(world)
        dist.all_to_all_single(got, mine, sizes, [sizes[rank]] * world)

    def all_to_all_sum():
        got = torch.empty(world * sizes[rank])
        dist.all_to_all_single(got, torch.cat(bufs), [sizes[rank]] * world, sizes)
        got.view(world, -1).sum(0)

    fns = {
        "sum: gloo reduce per tensor": lambda: waited(
            [dist.reduce(b, dst=i, async_op=True) for i, b in enumerate(bufs)]
        ),
        "sum: direct transfers per tensor": lambda: waited(
            [reduce_start(b, i, dist.group.WORLD) for i, b in enumerate(bufs)]
        ),
        "sum: gloo gather per tensor": lambda: waited(
            [
                dist.gather(b, inbox[i] if i == rank else None, dst=i, async_op=True)
                for i, b in enumerate(bufs)
            ]
        ),
        "sum: one uneven reduce_scatter": lambda: dist.reduce_scatter(out, bufs),
        "sum: one all_to_all (the owner adds)": all_to_all_sum,
        "copy: gloo broadcast per tensor": lambda: waited(
            [dist.broadcast(b, src=i, async_op=True) for i, b in enumerate(bufs)]
        ),
        "copy: direct sends per tensor": direct_broadcasts,
        "copy: one all_to_all": all_to_all,
        "copy: one padded all_gather": lambda: dist.all_gather_into_tensor(gathered, padded),
    }
    times: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():
        fn()
    for _ in range(reps):
        for k, fn in fns.items():
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    return {k: sorted(v)[len(v) // 2] for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    sizes = [SIZES[i % len(SIZES)] for i in range(args.world)]
    print(f"# {machine()}; {args.world} gloo ranks, 1 thread each")
    print(
        f"# tensors of {', '.join(str(s) for s in sizes)} fp32 elements, tensor i owned by rank i"
    )
    print("\n| how | ms (median, rank 0) |\n|---|---|")
    for k, t in run_ranks(_rank, args.world, args.reps).items():
        print(f"| {k} | {t * 1e3:.2f} |")


if __name__ == "__main__":
    main()
