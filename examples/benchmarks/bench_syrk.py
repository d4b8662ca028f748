"""dmuon::syrk's CPU kernel (blocked lower-triangle strips) vs one full GEMM `A @ A.mT`.

Prints, per dtype and shape (n rows, k inner), both times and the ratio, measured side by side,
and the strip count the kernel chose from the strip table this machine's dispatch measured
(dmuon_fn/ns/_dispatch.py; the rule in custom_ops/_kernels/cpu.py, `_cpu_blocks`).
Run: python examples/benchmarks/bench_syrk.py [--reps 7]
"""

from __future__ import annotations

import argparse

import torch
from _timing import interleaved_median, machine

import dmuon_fn
from custom_ops._kernels.cpu import _cpu_blocks

SHAPES = [
    (256, 1024),
    (512, 512),
    (512, 2048),
    (768, 768),
    (1024, 1024),
    (1024, 4096),
    (2048, 2048),
    (2048, 8192),
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    print(f"# syrk, {machine()}")
    print(f"# {dmuon_fn.get_ns_backend('cpu')}")  # installs this machine's strip table
    print("| dtype | n×k | strips | A@A.mT ms | dmuon::syrk ms | speedup |")
    print("|---|---|---|---|---|---|")
    for dtype in (torch.bfloat16, torch.float32):
        for n, k in SHAPES:
            A = torch.randn(n, k).to(dtype)
            t = interleaved_median(
                {"mm": lambda: A @ A.mT, "syrk": lambda: torch.ops.dmuon.syrk(A)},
                reps=args.reps,
            )
            print(
                f"| {str(dtype)[6:]} | {n}×{k} | {_cpu_blocks(n)} | {t['mm'] * 1e3:.2f} "
                f"| {t['syrk'] * 1e3:.2f} | {t['mm'] / t['syrk']:.2f}x |",
                flush=True,
            )


if __name__ == "__main__":
    main()
