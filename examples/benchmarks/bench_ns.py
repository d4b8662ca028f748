"""Newton-Schulz on this CPU: dmuon_fn vs torch.optim.Muon vs plain fp32 standard NS.

For 1024×1024 … 1024×8192 (aspect 1, 2, 4, 8) prints, measured side by side in one run:
- dmuon_fn.orthogonalize (defaults: Polar Express, method auto, bf16 iterates) and one full
  dmuon_fn.muon_update step (momentum, NS, parameter update) on one parameter;
- torch.optim.Muon: one step() on one parameter (Keller coefficients, bf16 NS);
- plain fp32 standard NS (Polar Express), as written in DESIGN.md;
each with its error against the float64 polar factor of the same gradient, and the ratios
torch step / dmuon orthogonalize (the issue's target at aspect 4: >= 1.5x) and torch step /
dmuon step. Run: python examples/benchmarks/bench_ns.py [--reps 7]
"""

from __future__ import annotations

import argparse

import torch
from _timing import interleaved_median, machine, polar_error
from torch.optim._muon import _zeropower_via_newtonschulz

import dmuon_fn
from dmuon_fn._coefficients import schedule
from dmuon_fn._cost import ns_method


def plain_fp32_ns(G: torch.Tensor) -> torch.Tensor:
    X = G.float()
    tall = X.shape[0] > X.shape[1]
    X = (X.T if tall else X) / (X.norm() + 1e-7)
    for a, b, c in schedule("polar_express", 5):
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    return X.T if tall else X


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--rows", type=int, default=1024)
    args = ap.parse_args()
    torch.manual_seed(0)
    print(f"# Newton-Schulz, {machine()}")
    print(f"# {dmuon_fn.get_ns_backend('cpu')}")
    print(
        "| shape | method | dmuon orth ms | dmuon step ms | torch Muon step ms | fp32 NS ms "
        "| torch step/dmuon orth | torch/dmuon step | err dmuon | err torch | err fp32 |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    n = args.rows
    for aspect in (1, 2, 4, 8):
        shape = (n, n * aspect)
        G = torch.randn(shape)
        p = torch.randn(shape)
        ref = torch.nn.Parameter(p.clone())
        opt = torch.optim.Muon([ref], lr=0.02, momentum=0.95, weight_decay=0.0)
        ref.grad = G.clone()
        state = dmuon_fn.muon_init(p)
        lr = torch.tensor(0.02)
        t = interleaved_median(
            {
                "orth": lambda: dmuon_fn.orthogonalize(G),
                "step": lambda: dmuon_fn.muon_update(p, G, state, lr=lr),
                "torch": opt.step,
                "fp32": lambda: plain_fp32_ns(G),
            },
            reps=args.reps,
        )
        # Errors: each method's orthogonalization of the same Nesterov input (∝ G on step 1).
        e_dm = polar_error(dmuon_fn.orthogonalize(G), G)
        e_t = polar_error(_zeropower_via_newtonschulz(G, (3.4445, -4.775, 2.0315), 5, 1e-7), G)
        e_32 = polar_error(plain_fp32_ns(G), G)
        method = ns_method(shape)
        print(
            f"| {shape[0]}×{shape[1]} | {method} | {t['orth'] * 1e3:.0f} | {t['step'] * 1e3:.0f} "
            f"| {t['torch'] * 1e3:.0f} | {t['fp32'] * 1e3:.0f} | {t['torch'] / t['orth']:.2f}x "
            f"| {t['torch'] / t['step']:.2f}x "
            f"| {e_dm:.3f} | {e_t:.3f} | {e_32:.3f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
