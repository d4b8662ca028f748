"""What Newton-Schulz adds per step at 64 and 1,024 ranks, read from the plan before launching.

For every model in the shapes directory ({"model": ..., "params": [[name, shape], ...]}), plans
it at 64 and 1,024 ranks (1-D) and prints the plan summary's job line (`dmuon_fn.plan_summary`)
as markdown, twice:

- block matrices as Muon; embeddings, the LM head and every non-matrix elementwise (AdamW), as
  Muon is usually run (the matrices outside the repeated blocks are the embeddings and head);
- every parameter of 2+ dims as Muon: then a 128k-vocabulary embedding or head is the largest
  matrix and sets the bound.

Columns: the teams (matrices, members; proofs/partition.md §10), total NS TFLOP per step in
the job (the teams' redundant work included), the busiest rank's, imbalance = busiest / mean,
the busiest and the mean rank's NS time per step at H100_FLOPS (an assumption, below) with
their team collectives at BANDWIDTH and their ratio, the same model planned with one owner per
matrix (no teams, no slices), and the busiest rank's NS time at this machine's GEMM rate,
measured by `dmuon_fn.measure_gemm_flops()` in the NS iteration dtype its dispatch picks.

    PYTHONPATH=. python examples/benchmarks/bench_summary.py [--shapes DIR] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from _timing import machine

import dmuon_fn
from dmuon_fn.ns._dispatch import iteration_dtype
from dmuon_fn.planning._partition import FLOPS_PER_BYTE

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_SHAPES = ROOT.parent / "shared" / "data" / "model_shapes"
WORLDS = (64, 1024)
# An assumption, not a measurement: ~40% of an H100 SXM's 989 TFLOP/s dense bf16 peak. Large
# square bf16 GEMMs reach well above that; NS's products (sides 768..28672, half of them
# symmetric) and per-matrix launches reach less, so this is a round, conservative figure.
H100_FLOPS = 4e14
# The bytes/s a team's collectives move, the cost model's default 1024 FLOP per byte against
# that rate (about NVLink's all-reduce bus bandwidth within a node; across nodes it is less).
BANDWIDTH = H100_FLOPS / FLOPS_PER_BYTE


def in_block(name: str) -> bool:
    """Inside a repeated block (`layers.3`, `h.3`): not an embedding or the head."""
    return any(part.isdigit() for part in name.split("."))


def rows(path: Path, world: int, all_matrices: bool, local_flops: float) -> dict:
    spec = json.loads(path.read_text())
    named = {n: tuple(s) for n, s in spec["params"]}
    ew = [n for n, s in named.items() if len(s) < 2 or not (all_matrices or in_block(n))]
    t0 = time.perf_counter()
    plan = dmuon_fn.partition(named, world, elementwise=ew)
    s = dmuon_fn.plan_summary(plan, gemm_flops=H100_FLOPS, bandwidth=BANDWIDTH)
    plan_ms = 1e3 * (time.perf_counter() - t0)
    whole = dmuon_fn.partition(named, world, elementwise=ew, slices=False)
    return {
        "model": spec["model"],
        "world": world,
        "matrices": len(named) - len(ew),
        "summary": s,
        "one": dmuon_fn.plan_summary(whole, gemm_flops=H100_FLOPS),
        "local_s": max(r.rank_ns_flops / local_flops for r in s.slots),
        "plan_ms": plan_ms,
    }


def table(results: list[dict]) -> str:
    out = [
        "| model | ranks | matrices | teams: matrices (members) | NS TFLOP/step, all | busiest "
        "TFLOP | busiest/mean | busiest ms @ H100 | mean ms | busiest/mean, s | one owner each: "
        "busiest/mean | busiest ms | busiest s here |",
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for r in results:
        s, one = r["summary"], r["one"]
        teams = f"{len(s.teams)} ({sum(t[1] for t in s.teams)})" if s.teams else "-"
        out.append(
            f"| {r['model']} | {r['world']:,} | {r['matrices']} | {teams} "
            f"| {s.total_ns_flops / 1e12:.2f} | {s.busiest_ns_flops / 1e12:.3f} "
            f"| {s.imbalance:.2f} | {1e3 * s.busiest_seconds:.3g} | {1e3 * s.mean_seconds:.3g} "
            f"| {s.imbalance_seconds:.2f} | {one.imbalance:.2f} "
            f"| {1e3 * one.busiest_seconds:.3g} | {r['local_s']:.3g} |"
        )
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", type=Path, default=DEFAULT_SHAPES)
    ap.add_argument("--out", type=Path, help="also write the markdown here")
    args = ap.parse_args()
    files = sorted(args.shapes.glob("*.json"))
    if not files:
        raise SystemExit(f"no *.json shape files in {args.shapes}")

    dtype = iteration_dtype(torch.device("cpu"))
    local = max(dmuon_fn.measure_gemm_flops("cpu") for _ in range(3))  # best of 3 measurements
    command = f"PYTHONPATH=. python examples/benchmarks/bench_summary.py {' '.join(sys.argv[1:])}"
    lines = [
        "# Newton-Schulz per step from the plan summary",
        "",
        f"`{command.strip()}`",
        "",
        f"Machine: {machine()}.",
        "",
        f"GEMM rates: H100 {H100_FLOPS:.0e} FLOP/s, assumed (about 40% of an H100 SXM's 989 "
        "TFLOP/s dense bf16 peak; not measured here); here "
        f"{local / 1e9:.0f} GFLOP/s, a 1024³ {str(dtype)[6:]} GEMM measured by "
        "`measure_gemm_flops()` (best of 3), which is the NS iteration dtype this CPU's "
        "dispatch picks.",
        "",
        "FLOPs are the planner's count (`ns_flops`: 5 steps, symmetric products at half a "
        "GEMM, Gram NS from long/short >= 1.5, a GPU's ratio); seconds = the busiest rank's "
        "FLOPs / the rate: the Newton-Schulz time Muon adds to a step if nothing hides it, a "
        "floor (smaller GEMMs run below the rate, and each call has a fixed cost: ~2 ms on a "
        "CPU, dmuon_fn/planning/_partition.py). The plans give the costliest matrices teams "
        "(proofs/partition.md §10); a team member's seconds add its collectives at "
        f"{BANDWIDTH:.3g} B/s (the cost model's default bytes-to-FLOPs rate at the H100 rate: "
        "about an all-reduce's bus bandwidth within an NVLink node, not across nodes). "
        "busiest/mean: NS FLOPs (the redundant work of teams counted); busiest/mean, s: the "
        "same in seconds, team collectives included (what the busiest rank adds to a step "
        "over an even share); 'one owner each': the same model planned without teams or "
        "slices.",
    ]
    for all_matrices, title in (
        (False, "Block matrices as Muon; embeddings, head and non-matrices elementwise"),
        (True, "Every parameter of 2+ dims as Muon"),
    ):
        results = [rows(p, w, all_matrices, local) for p in files for w in WORLDS]
        lines += ["", f"## {title}", "", table(results)]
        slowest = max(r["plan_ms"] for r in results)
        lines += ["", f"Planning and summarizing took at most {slowest:.0f} ms per row."]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
