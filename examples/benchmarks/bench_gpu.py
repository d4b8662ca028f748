"""GPU: dmuon::syrk's tensor-core triangle kernels vs one cuBLAS GEMM, and dmuon_fn.orthogonalize
vs torch.optim.Muon's Newton-Schulz.

Part 1, SYRK: A is size × (ratio·size) bf16; prints torch.mm(A, A.mT) and dmuon::syrk with each
triangle kernel this GPU can run (cute_sm80, quack), in ms, and the ratio mm / kernel.
Target on H100/H200: >= 1.6x for size >= 4096.
Part 2, orthogonalize: G is size × (ratio·size) fp32; prints dmuon_fn.orthogonalize (defaults:
5 Polar Express steps, Gram NS above aspect 1.5, bf16 iterates, auto kernel, and each triangle
kernel) and torch.optim.Muon's `_zeropower_via_newtonschulz` (5 Keller steps, bf16), in ms,
and the ratio torch / dmuon. Target on H100/H200: >= 1.5x at ratio 4.
Times are medians of CUDA-event timings after a warm-up call (which compiles any kernel).

Run: python examples/benchmarks/bench_gpu.py [--sizes 1024 2048 4096 8192] [--ratios 1 2 4 8]
     [--reps 10] [--part syrk|ns|both] [--check]
"""

from __future__ import annotations

import argparse

import torch
from torch.optim._muon import _zeropower_via_newtonschulz

import custom_ops
import dmuon_fn

KELLER = (3.4445, -4.7750, 2.0315)
TRIANGLE_KERNELS = ("cute_sm80", "quack")


def cuda_median(fn, reps: int) -> float:
    """Median milliseconds of `fn` over `reps` calls, after one warm-up call."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def runnable(device: torch.device) -> list[str]:
    names = []
    for name in TRIANGLE_KERNELS:
        ok, why = custom_ops.KERNELS[name].available(device)
        if ok:
            names.append(name)
        else:
            print(f"# {name}: skipped, {why}")
    return names


def bench_syrk(sizes, ratios, reps, kernels, check) -> None:
    print("\n## SYRK: A (n × ratio·n) bf16, C = A·Aᵀ")
    cols = "".join(f" {k} ms | mm/{k} |" for k in kernels)
    print(f"| n | k | mm ms |{cols}")
    print("|---|---|---|" + "---|---|" * len(kernels))
    for n in sizes:
        for r in ratios:
            A = torch.randn(n, r * n, device="cuda", dtype=torch.bfloat16)
            t_mm = cuda_median(lambda: torch.mm(A, A.mT), reps)
            row = f"| {n} | {r * n} | {t_mm:.3f} |"
            for k in kernels:
                t = cuda_median(lambda: torch.ops.dmuon.syrk(A, impl=k), reps)
                row += f" {t:.3f} | {t_mm / t:.2f}x |"
                if check:
                    out, ref = torch.ops.dmuon.syrk(A, impl=k).float(), torch.mm(A, A.mT).float()
                    rel = ((out - ref).norm() / ref.norm()).item()
                    row += f" (rel {rel:.1e})"
            print(row, flush=True)


def bench_ns(sizes, ratios, reps, kernels, check) -> None:
    print("\n## orthogonalize: G (n × ratio·n) fp32, 5 steps")
    variants = ["auto", *kernels]
    cols = "".join(f" dmuon[{v}] ms | torch/dmuon[{v}] |" for v in variants)
    print(f"| shape | torch.optim.Muon NS ms |{cols}")
    print("|---|---|" + "---|---|" * len(variants))
    for n in sizes:
        for r in ratios:
            G = torch.randn(n, r * n, device="cuda")
            t_torch = cuda_median(lambda: _zeropower_via_newtonschulz(G, KELLER, 5, 1e-7), reps)
            row = f"| {n}×{r * n} | {t_torch:.3f} |"
            for v in variants:
                kernel = None if v == "auto" else v
                t = cuda_median(lambda: dmuon_fn.orthogonalize(G, kernel=kernel), reps)
                row += f" {t:.3f} | {t_torch / t:.2f}x |"
            if check and n * r * n <= 2048 * 8192:
                U, _, Vh = torch.linalg.svd(G.double(), full_matrices=False)
                P = U @ Vh
                err = lambda O: ((O.double() - P).norm() / P.norm()).item()  # noqa: E731
                row += (
                    f" err dmuon {err(dmuon_fn.orthogonalize(G)):.3f}"
                    f", torch {err(_zeropower_via_newtonschulz(G, KELLER, 5, 1e-7)):.3f}"
                )
            print(row, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    ap.add_argument("--ratios", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--part", choices=["syrk", "ns", "both"], default="both")
    ap.add_argument("--check", action="store_true", help="also print errors vs references")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_gpu.py needs a CUDA device")
    device = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    print(f"# {torch.cuda.get_device_name(device)}, torch {torch.__version__}")
    print(f"# {dmuon_fn.get_ns_backend(device)}")
    kernels = runnable(device)
    if args.part in ("syrk", "both"):
        bench_syrk(args.sizes, args.ratios, args.reps, kernels, args.check)
    if args.part in ("ns", "both"):
        bench_ns(args.sizes, args.ratios, args.reps, kernels, args.check)


if __name__ == "__main__":
    main()
