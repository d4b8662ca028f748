"""Does the planner's cost model predict measured `orthogonalize` time on this machine?

For a spread of shapes (square, wide, tall; Gram and standard iterations by the `auto` rule),
times `dmuon_fn.orthogonalize` on fp32 input with its defaults (best of `--repeats`), and
reports:
  - Pearson correlation of log(time) with log(cost), for the full cost (FLOPs + byte term) and for
    FLOPs alone;
  - ns per FLOP, fitted through the origin (time ≈ α·cost);
  - the two-term fit time ≈ α·FLOPs + β·bytes, whose β/α is the FLOP-equivalent of one byte.

    PYTHONPATH=. python examples/benchmarks/bench_cost_model.py [--repeats 3] [--threads N]
"""

from __future__ import annotations

import argparse
import math
import time

import torch
from _timing import machine

import dmuon_fn
from dmuon_fn.ns._cost import ns_flops, ns_method
from dmuon_fn.ns._dispatch import gram_rule
from dmuon_fn.planning._partition import FLOPS_PER_BYTE, partition

SHAPES = [
    (128, 128), (256, 256), (512, 512), (1024, 1024), (1536, 1536),
    (256, 1024), (512, 2048), (1024, 4096), (4096, 1024), (768, 3072),
    (3072, 768), (1024, 1536), (128, 4096), (512, 768), (2048, 512), (64, 8192),
]  # fmt: skip


def _times(shapes, repeats: int) -> list[float]:
    """Best of `repeats` per shape, in rounds over all shapes, so a burst of load from another
    process inflates one sample of each shape rather than every sample of a few."""
    g = torch.Generator().manual_seed(0)
    inputs = [torch.randn(*shape, generator=g) for shape in shapes]
    for G in inputs:
        dmuon_fn.orthogonalize(G)  # warm-up: allocations, kernel choice
    best = [math.inf] * len(shapes)
    for _ in range(repeats):
        for i, G in enumerate(inputs):
            t0 = time.perf_counter()
            dmuon_fn.orthogonalize(G)
            best[i] = min(best[i], time.perf_counter() - t0)
    return best


def _pearson(x, y) -> float:
    mx, my = sum(x) / len(x), sum(y) / len(y)
    sxy = sum((a - mx) * (b - my) for a, b in zip(x, y, strict=True))
    sxx = sum((a - mx) ** 2 for a in x)
    syy = sum((b - my) ** 2 for b in y)
    return sxy / math.sqrt(sxx * syy)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"# {machine()}; backend {dmuon_fn.get_ns_backend()}")
    rule = gram_rule(torch.device("cpu"))  # where orthogonalize(G) runs Gram
    aspect, least = rule["gram_min_aspect"], rule["gram_min_short"]
    print("| shape | method | GFLOP | MB fp32 | time ms | ns/FLOP |")
    print("|---|---|---|---|---|---|")
    rows = []
    for shape, t in zip(SHAPES, _times(SHAPES, args.repeats), strict=True):
        flops = ns_flops(shape, min_aspect=aspect, min_short=least)
        nbytes = 4 * shape[0] * shape[1]
        cost = partition({"w": shape}, 1, **rule).costs[0]  # the planner's
        rows.append((shape, flops, nbytes, cost, t))
        method = ns_method(shape, min_aspect=aspect, min_short=least)
        print(f"| {shape[0]}×{shape[1]} | {method} | {flops / 1e9:.2f} | "
              f"{nbytes / 1e6:.2f} | {t * 1e3:.2f} | {t / flops * 1e9:.3f} |")  # fmt: skip
    logt = [math.log(r[4]) for r in rows]
    r_full = _pearson([math.log(r[3]) for r in rows], logt)
    r_flops = _pearson([math.log(r[1]) for r in rows], logt)
    alpha = sum(r[3] * r[4] for r in rows) / sum(r[3] ** 2 for r in rows)
    # Two-term least squares, relative errors (each row divided by its time) so the big shapes
    # do not decide alone: minimise Σ((α·F + β·B)/t − 1)².
    a11 = sum((r[1] / r[4]) ** 2 for r in rows)
    a12 = sum(r[1] * r[2] / r[4] ** 2 for r in rows)
    a22 = sum((r[2] / r[4]) ** 2 for r in rows)
    b1, b2 = sum(r[1] / r[4] for r in rows), sum(r[2] / r[4] for r in rows)
    det = a11 * a22 - a12 * a12
    fa, fb = (b1 * a22 - b2 * a12) / det, (a11 * b2 - a12 * b1) / det
    print()
    print(f"Pearson r, log time vs log cost (FLOPs + {FLOPS_PER_BYTE:g}·bytes): {r_full:.4f}")
    print(f"Pearson r, log time vs log FLOPs alone: {r_flops:.4f}")
    print(f"fitted time/cost through the origin: {alpha * 1e9:.4f} ns per FLOP")
    print(f"two-term fit: {fa * 1e9:.4f} ns/FLOP + {fb * 1e9:.4f} ns/byte "
          f"(one byte ≈ {fb / fa:.1f} FLOPs)")  # fmt: skip


if __name__ == "__main__":
    main()
