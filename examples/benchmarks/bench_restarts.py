"""Which Gram-NS restart schedule keeps bf16 error at the standard iteration's level.

For random spectra (log-spaced to 1e-6, rank-deficient, rank-1 plus noise, a 'cliff' of two
levels, Gaussian), sizes 2..192 rows and aspect 1.5..8, prints per restart schedule and size
band: how often Gram NS lands more than 0.02 above standard NS's error against the float64
polar factor, how often it diverges (error > 1), and the worst gap. The default
(`dmuon_fn.ns._cost.default_restarts`, with GRAM_MIN_SHORT) comes from this table.
Run: python examples/benchmarks/bench_restarts.py [--trials 200]
"""

from __future__ import annotations

import argparse
import random

import torch
from _timing import machine, polar_error

from dmuon_fn import orthogonalize

SCHEDULES = [(), (2,), (3,), (1, 3), (2, 4)]
BANDS = [(2, 12), (16, 31), (32, 192)]


def spectrum(kind: str, n: int, rng: random.Random, g: torch.Generator) -> torch.Tensor:
    if kind == "logspace":
        return torch.logspace(0, -rng.uniform(0, 6), n, dtype=torch.float64)
    if kind == "rank1":
        tail = torch.rand(n - 1, generator=g, dtype=torch.float64) * rng.choice([1e-1, 1e-2, 1e-3])
        return torch.cat([torch.ones(1, dtype=torch.float64), tail])
    if kind == "rankdef":
        k = rng.randint(1, n)
        head = torch.rand(k, generator=g, dtype=torch.float64) + 0.1
        return torch.cat([head, torch.zeros(n - k, dtype=torch.float64)])
    low = rng.choice([0.1, 0.03, 0.01])
    return torch.cat([torch.ones(n // 2), torch.full((n - n // 2,), low)]).double()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=200)
    args = ap.parse_args()
    rng, g = random.Random(0), torch.Generator().manual_seed(0)
    stats = {(s, b): [0, 0, 0.0, 0] for s in SCHEDULES for b in BANDS}
    for _ in range(args.trials):
        band = rng.choice(BANDS)
        n = rng.randint(*band)
        m = int(n * rng.choice([1.5, 2, 3, 4, 8]))
        kind = rng.choice(["logspace", "rank1", "rankdef", "cliff", "gauss"])
        if kind == "gauss":
            G = torch.randn(n, m, generator=g, dtype=torch.float64)
        else:
            U, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
            V, _ = torch.linalg.qr(torch.randn(m, n, generator=g, dtype=torch.float64))
            G = (U * spectrum(kind, n, rng, g)) @ V.T
        Gf = G.float()
        e_std = polar_error(orthogonalize(Gf, method="standard"), G)
        for sched in SCHEDULES:
            e = polar_error(
                orthogonalize(Gf, method="gram", restarts=sched, dtype=torch.bfloat16)
                if n >= 32
                else _small_gram(Gf, sched),
                G,
            )
            st = stats[(sched, band)]
            st[0] += e > e_std + 0.02
            st[1] += e > 1.0
            st[2] = max(st[2], e - e_std)
            st[3] += 1
    print(f"# Gram restarts in bf16, {machine()}, {args.trials} random matrices")
    print("| restarts | rows | worse by > 0.02 | diverged | worst gap |")
    print("|---|---|---|---|---|")
    for (sched, band), (worse, div, gap, count) in stats.items():
        print(
            f"| {sched or '()'} | {band[0]}..{band[1]} | {worse}/{count} | {div}/{count} "
            f"| {gap:.3g} |"
        )


def _small_gram(G: torch.Tensor, sched: tuple[int, ...]) -> torch.Tensor:
    """bf16 Gram NS below GRAM_MIN_SHORT, which `orthogonalize` refuses: same ops, run directly."""
    from dmuon_fn.ns._iteration import gram, normalize, schedule

    tall = G.shape[0] > G.shape[1]
    X = normalize(G.T.contiguous() if tall else G, 1e-7).bfloat16()
    out = gram(X, schedule("polar_express", 5), frozenset(sched), "cpu_syrk")
    return out.T if tall else out


if __name__ == "__main__":
    main()
