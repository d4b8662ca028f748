"""Resident bytes per rank in the plan, with and without the byte balance, side by side.

For every model in the shapes directory, at 64, 256 and 1,024 ranks (1-D), two ways to run it:

- blocks: the block matrices dedicated (Muon), everything else on FSDP2 with AdamW, as the object
  API runs it (`dedicate_params(predicate=...)` + `fully_shard`): the plan holds the block
  matrices, and every rank holds 1/W of the rest (fp32 master and AdamW's two moments);
- all: every parameter dedicated, each 2+-D one a Muon matrix (`pure=True`, the functional
  face): embeddings and head on Muon.

Printed: the busiest / mean resident bytes (fp32 masters and optimizer states,
`dmuon_fn.planning._memory.resident`, plus the FSDP2 share) and the busiest rank's
Newton-Schulz seconds per step
(`plan_summary` at bench_summary's H100_FLOPS and BANDWIDTH), planned with
`balance_bytes=False` (the schedule by seconds alone) and with the default (batches also cut by
bytes, units moved or swapped off the byte-heaviest ranks within the busiest NS load, the
candidate plans weighed by bytes too, and matrices still too heavy for their owner held in
gathered pieces, proofs/partition.md §12); the ratio of the NS seconds, after / before; that
of the busiest slot's whole load in the plan's cost model (NS and per-byte costs: a gathered
piece's bytes cost its holder, up to LOAD_SLACK over the busiest); the gathered groups after and
the most bytes a rank moves for them per step (their two all-to-alls, fp32); planning seconds
after.

    PYTHONPATH=. python examples/benchmarks/bench_plan_memory.py [--shapes DIR] [--worlds ...]
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

from bench_summary import BANDWIDTH, DEFAULT_SHAPES, H100_FLOPS, in_block

import dmuon_fn
from dmuon_fn.planning._memory import BALANCED, resident


def row(named: dict, fsdp: int, world: int, balance: bool) -> tuple:
    """(bytes busiest / mean, busiest NS seconds, planning seconds, gathered groups, the most
    bytes a rank's gathered all-to-alls move per step, the busiest slot's whole load: NS and
    per-byte costs) of `named` dedicated, the FSDP2 share of `fsdp` elements on every rank."""
    ew = [n for n, s in named.items() if len(s) < 2]
    t0 = time.perf_counter()
    plan = dmuon_fn.partition(named, world, elementwise=ew, balance_bytes=balance)
    took = time.perf_counter() - t0
    s = dmuon_fn.plan_summary(plan, gemm_flops=H100_FLOPS, bandwidth=BANDWIDTH)
    held = [b + 12 * fsdp / world for b in resident(plan).total]
    moved = max(r.gather_bytes for r in s.slots)
    top = max(plan.slot_loads)
    return max(held) / (sum(held) / world), s.busiest_seconds, took, len(plan.gathered), moved, top


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", type=Path, default=DEFAULT_SHAPES)
    parser.add_argument("--worlds", type=int, nargs="+", default=[64, 256, 1024])
    args = parser.parse_args()
    print("| model | Muon on | ranks | bytes busiest/mean before | after | NS ms before | after "
          "| after / before | busiest load after / before | gathered groups | gathered MiB/step "
          "| planning s |")  # fmt: skip
    print("|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|")
    met = worse = total = 0
    for path in sorted(args.shapes.glob("*.json")):
        named = {n: tuple(s) for n, s in json.loads(path.read_text())["params"]}
        for all_matrices in (False, True):
            mine = {n: s for n, s in named.items() if all_matrices or (len(s) > 1 and in_block(n))}
            fsdp = sum(math.prod(s) for n, s in named.items() if n not in mine)
            for world in args.worlds:
                b0, s0, *_, top0 = row(mine, fsdp, world, False)
                b1, s1, took, groups, moved, top1 = row(mine, fsdp, world, True)
                total += 1
                met += b1 <= BALANCED
                worse += s1 > 1.05 * s0
                print(f"| {path.stem} | {'all' if all_matrices else 'blocks'} | {world} | "
                      f"{b0:.3f} | {b1:.3f} | {1e3 * s0:.4g} | {1e3 * s1:.4g} | {s1 / s0:.3f} | "
                      f"{top1 / top0:.3f} | {groups} | {moved / 2**20:.4g} | {took:.2f} |",
                      flush=True)  # fmt: skip
    print(f"\nbytes busiest/mean <= {BALANCED}: {met} of {total} rows; NS seconds more than 5% "
          f"worse: {worse} of {total}")  # fmt: skip


if __name__ == "__main__":
    main()
