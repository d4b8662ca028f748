"""Partition quality and planning time on real model shapes.

For every model in the shapes directory ({"model": ..., "params": [[name, shape], ...]}), plans
the block matrices (2-D params; embeddings and the LM head excluded: they are usually updated
by AdamW, and a 128k-vocabulary head alone outweighs ~20 block matrices) at world sizes 8, 64,
512 and HSDP 8×8, with plain LPT and with the refined plan, and prints per row:

  n       matrices planned
  LB/mean the compute lower bound max(total/S, p1, p_S + p_{S+1}) over the mean load: above 1,
          no plan can be balanced (one big matrix, or more matrices than slots by too little)
  c/LB    max compute load / that lower bound (target <= 1.03 at 8, 64, 8×8)
  c max/mean
  b max/mean  bytes per slot (1-D) or per shard column (HSDP); "b LB" is the same kind of bound
          for bytes (target <= 1.3 where b LB allows it)
  coll    layers with two matrices on one owner (one shard column under HSDP) although the
          layer has at most that many matrices (target 0)
  ms      planning time

A second table plans whole models (every parameter: embeddings and head as Muon matrices,
norms packed per layer) to show the bound a single large matrix sets once W is large.

    PYTHONPATH=. python examples/benchmarks/bench_partition.py [--shapes DIR]
"""

from __future__ import annotations

import argparse
import json
import re
import time
from collections import defaultdict
from pathlib import Path

from dmuon_fn.planning._partition import partition
from dmuon_fn.planning._plan import Plan

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_SHAPES = ROOT.parent / "shared" / "data" / "model_shapes"
MESHES = [(8, 1), (64, 1), (64, 8), (512, 1)]  # (world size, replicate size)
EXCLUDE = re.compile(r"embed|wte|wpe|lm_head")  # embeddings and the LM head


def lower_bound(values, slots: int) -> float:
    p = sorted(values, reverse=True)
    lb = max(sum(p) / slots, p[0])
    return max(lb, p[slots - 1] + p[slots]) if len(p) > slots else lb


def collisions(plan: Plan) -> int:
    """Layers with two matrices in one shard column although they have <= shard_size."""
    per: dict[str, list[int]] = defaultdict(list)
    for layer, m, s in zip(plan.layers, plan.matrix, plan.slots, strict=True):
        if m:
            per[layer].append(s % plan.shard_size)
    return sum(len(c) <= plan.shard_size and len(set(c)) < len(c) for c in per.values())


def _mesh(world: int, rep: int) -> str:
    return f"{world // rep}×{rep}" if rep > 1 else str(world)


def row(plan: Plan, ms: float) -> dict:
    S, G = plan.world_size, plan.shard_size
    mean, top = sum(plan.slot_loads) / S, max(plan.slot_loads)
    lb = lower_bound(plan.costs, S)
    per = plan.slot_bytes
    if plan.replicate_size > 1:  # bytes per shard column
        per = [sum(plan.slot_bytes[c::G]) for c in range(G)]
    bmean = sum(per) / len(per)
    # Under HSDP a column gathers R slots, so only the largest single matrix bounds it.
    hsdp = plan.replicate_size > 1
    blb = max(bmean, max(plan.nbytes)) if hsdp else lower_bound(plan.nbytes, S)
    return {
        "lb": lb / mean, "c_lb": top / lb, "c_mean": top / mean,
        "b": max(per) / bmean, "b_lb": blb / bmean, "coll": collisions(plan),
        "ms": ms, "groups": G,
    }  # fmt: skip


def timed(named, world, rep, **kw) -> tuple[Plan, float]:
    t0 = time.perf_counter()
    plan = partition(named, world, replicate_size=rep, **kw)
    return plan, (time.perf_counter() - t0) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", type=Path, default=DEFAULT_SHAPES)
    args = ap.parse_args()
    models = [json.loads(f.read_text()) for f in sorted(args.shapes.glob("*.json"))]
    fails: list[str] = []

    print("## Block matrices (embeddings and LM head excluded)\n")
    print("| model | W | n | LB/mean | LPT c/LB | LPT b max/mean | LPT coll | LPT ms "
          "| refined c/LB | c max/mean | b max/mean | b LB | coll | ms |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for m in models:
        named = [(n, s) for n, s in m["params"] if len(s) >= 2 and not EXCLUDE.search(n)]
        for world, rep in MESHES:
            base = row(*timed(named, world, rep, refine=False))
            ref = row(*timed(named, world, rep))
            mesh = _mesh(world, rep)
            print(f"| {m['model']} | {mesh} | {len(named)} | {ref['lb']:.3f} | "
                  f"{base['c_lb']:.4f} | {base['b']:.3f} | {base['coll']} | {base['ms']:.0f} | "
                  f"{ref['c_lb']:.4f} | {ref['c_mean']:.3f} | {ref['b']:.3f} | "
                  f"{ref['b_lb']:.3f} | {ref['coll']} | {ref['ms']:.0f} |")  # fmt: skip
            tag = f"{m['model']} at {mesh}"
            if world <= 64 and ref["c_lb"] > 1.03:
                fails.append(f"{tag}: compute {ref['c_lb']:.4f} x lower bound > 1.03")
            if world <= 64 and ref["b"] > 1.3 and ref["b_lb"] <= 1.3:
                fails.append(f"{tag}: bytes max/mean {ref['b']:.3f} > 1.3")
            if ref["coll"]:
                fails.append(f"{tag}: {ref['coll']} layers with two matrices on one owner")

    print("\n## Whole models (every parameter; embeddings and head as matrices)\n")
    print("| model | W | params | p1/mean | c max/mean | c/LB | largest | ms |")
    print("|---|---|---|---|---|---|---|---|")
    for m in models:
        for world, rep in [(64, 1), (512, 1)]:
            plan, ms = timed(m["params"], world, rep)
            mean, top = sum(plan.slot_loads) / world, max(plan.slot_loads)
            big = plan.names[max(range(len(plan.costs)), key=plan.costs.__getitem__)]
            c_lb = top / lower_bound(plan.costs, world)
            print(f"| {m['model']} | {world} | {len(plan.names)} | {max(plan.costs) / mean:.2f} "
                  f"| {top / mean:.2f} | {c_lb:.4f} | {big} | {ms:.0f} |")  # fmt: skip
            if m["model"] == "llama3-70b" and world == 512 and ms >= 1000:
                fails.append(f"llama3-70b at 512 planned in {ms:.0f} ms >= 1 s")

    print()
    print("targets: " + ("all met" if not fails else "MISSED:\n  " + "\n  ".join(fails)))


if __name__ == "__main__":
    main()
