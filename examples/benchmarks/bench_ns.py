"""Newton-Schulz on this CPU: every candidate the dispatch chooses from, next to its choice.

For 512×2048 and 1024×4096 (Polar Express, 5 steps) prints, measured side by side in one run:
- the four candidates bf16/fp32 iterates × standard/Gram NS (`orthogonalize(dtype=, method=)`),
  each with its error ‖O − U·Vᵀ‖_F / ‖U·Vᵀ‖_F against the float64 polar factor;
- the default `orthogonalize(G)` (what dmuon_fn/ns/_dispatch.py decided for this machine);
- the previous fixed default (before the dispatch: bf16 iterates, Gram from long/short 1.5,
  strips by a rule measured on one AVX-512 BF16 CPU, reproduced here), unless --no-previous;
- torch.optim.Muon: one step() on one parameter (Keller coefficients, bf16 NS), and the error
  of its Newton-Schulz;
then the target: the default's time over the fastest candidate whose error is no worse than
torch.optim.Muon's (<= 1.15x), and the previous default's time over the default's.

Then, per shape, one summary row (issue 27): the default against torch.optim.Muon's Newton-Schulz
(`_zeropower_via_newtonschulz`: bf16, Keller coefficients, 5 steps) and against the same quintic
run in fp32, and against the FLOP floor: the FLOPs of the form the default runs (`ns_flops`, a
symmetric product charged as the strips that run) at the rate of an n×n by n×m GEMM (n the short
side) in the iteration dtype, timed among the candidates in the same rounds (its median), so a
machine whose speed drifts moves the floor with them.

Run: python examples/benchmarks/bench_ns.py [--reps 5] [--shapes 1024x4096,...]
Slow bf16 (emulated, as on an AVX2-only CPU) on a CPU with AVX-512 BF16:
    ONEDNN_MAX_CPU_ISA=AVX2 python examples/benchmarks/bench_ns.py --reps 1 --warmup 0 --no-bf16
(--no-bf16: no bf16 run at all, each ~1 min there; the torch column is then its quintic in fp32)
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator

import torch
from _timing import interleaved_median, machine, polar_error
from torch.optim._muon import _zeropower_via_newtonschulz

import custom_ops._kernels.cpu as kernels
import dmuon_fn
from dmuon_fn.ns._cost import ns_flops, ns_method
from dmuon_fn.ns._dispatch import gram_min_aspect, gram_min_short, iteration_dtype

CANDIDATES = [(dt, m) for dt in (torch.bfloat16, torch.float32) for m in ("standard", "gram")]
KELLER = (3.4445, -4.775, 2.0315)


def _previous_blocks(n: int) -> int:
    """The strip rule before the dispatch (one GEMM below 512 rows, 2 to 768, 4 beyond),
    without its wide-operand refinement (8 strips at 1024+ rows when k >= 2n): within ±3% on
    the CPU it was measured on (BENCHMARKS.md, "SYRK")."""
    if n < 512:
        return 1
    return 4 if n >= 768 else 2


@contextlib.contextmanager
def previous_strips() -> Iterator[None]:
    now = kernels._cpu_blocks
    kernels._cpu_blocks = _previous_blocks
    try:
        yield
    finally:
        kernels._cpu_blocks = now


def previous_default(G: torch.Tensor) -> torch.Tensor:
    method = ns_method(G.shape, "auto", 1.5)
    with previous_strips():
        return dmuon_fn.orthogonalize(G, dtype=torch.bfloat16, method=method)


def torch_ns(G: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """torch.optim.Muon's Newton-Schulz (Keller coefficients, 5 steps) iterated in `dtype`."""
    if dtype == torch.bfloat16:
        return _zeropower_via_newtonschulz(G, KELLER, 5, 1e-7)
    a, b, c = KELLER
    X = G.to(dtype)
    tall = G.size(0) > G.size(1)
    X = X.mT if tall else X
    X = X / (X.norm() + 1e-7)
    for _ in range(5):
        A = X @ X.mT
        X = a * X + (b * A + c * A @ A) @ X
    return X.mT if tall else X


GEMM = "n×n·n×m GEMM"  # timed among the candidates: the floor's rate, in the same rounds


def gemm(shape: tuple[int, int], dtype: torch.dtype):
    """An n×n by n×m GEMM in `dtype` (n the short side), as a candidate to time."""
    n, m = min(shape), max(shape)
    A, X = torch.randn(n, n).to(dtype), torch.randn(n, m).to(dtype)
    return lambda: A @ X


def floor_seconds(shape: tuple[int, int], gemm_seconds: float) -> float:
    """The FLOPs of the form the default runs, symmetric products charged as the CPU kernel's
    strips compute them, at the rate of an n×n·n×m GEMM that took `gemm_seconds`."""
    cpu = torch.device("cpu")
    n, m = min(shape), max(shape)
    rule = {"min_aspect": gram_min_aspect(cpu), "min_short": gram_min_short(cpu)}
    flops = ns_flops(shape, **rule, sym_discount=kernels.strip_share(n))
    return flops * gemm_seconds / (2.0 * n * n * m)


def name(dt: torch.dtype, method: str) -> str:
    return f"{str(dt)[6:]} {method}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1, choices=(0, 1))
    ap.add_argument("--no-previous", action="store_true", help="skip the previous default")
    ap.add_argument(
        "--no-bf16",
        action="store_true",
        help="skip every bf16 run (the bf16 candidates, torch's bf16 NS): where bf16 is emulated",
    )
    ap.add_argument("--shapes", default="1024x4096,1536x4096,4096x1024,2048x2048")
    args = ap.parse_args()
    torch.manual_seed(0)
    print(f"# Newton-Schulz candidates, {machine()}")
    print(f"# {dmuon_fn.get_ns_backend('cpu')}")
    cpu = torch.device("cpu")
    summary = []
    for spec in args.shapes.split(","):
        shape = tuple(int(v) for v in spec.split("x"))
        G = torch.randn(shape)
        ref = torch.nn.Parameter(torch.randn(shape))
        opt = torch.optim.Muon([ref], lr=0.02, momentum=0.95, weight_decay=0.0)
        ref.grad = G.clone()
        fns = {
            name(dt, m): (lambda dt=dt, m=m: dmuon_fn.orthogonalize(G, dtype=dt, method=m))
            for dt, m in CANDIDATES
            if not (args.no_bf16 and dt == torch.bfloat16)
        }
        fns["default"] = lambda: dmuon_fn.orthogonalize(G)
        if not args.no_previous:
            fns["previous default"] = lambda: previous_default(G)
        if not args.no_bf16:
            fns["torch.optim.Muon step"] = opt.step
            fns["torch NS bf16"] = lambda: torch_ns(G, torch.bfloat16)
        fns["torch NS fp32"] = lambda: torch_ns(G, torch.float32)
        t = interleaved_median(
            {**fns, GEMM: gemm(shape, iteration_dtype(cpu))}, args.reps, bool(args.warmup)
        )
        err = {k: polar_error(fn(), G) for k, fn in fns.items() if k != "torch.optim.Muon step"}
        if not args.no_bf16:
            err["torch.optim.Muon step"] = err["torch NS bf16"]
        form = ns_method(shape, "auto", gram_min_aspect(cpu), gram_min_short(cpu))
        picked = name(iteration_dtype(cpu), form)
        print(f"\n{shape[0]}×{shape[1]}: the default runs {picked}\n")
        print("| candidate | ms | error vs polar factor |")
        print("|---|---|---|")
        for k in fns:
            mark = " (the default's)" if k == picked else ""
            print(f"| {k}{mark} | {t[k] * 1e3:.1f} | {err[k]:.4f} |")
        bar = err.get("torch.optim.Muon step", err["torch NS fp32"])
        ok = [k for k in (name(dt, m) for dt, m in CANDIDATES) if err.get(k, bar + 1) <= bar]
        best = min(ok or ["default"], key=lambda k: t[k])
        ratio = t["default"] / t[best]
        print(
            f"\ndefault / fastest candidate with error <= torch.optim.Muon's ({best}): "
            f"{ratio:.3f}x (target <= 1.15x: {'met' if ratio <= 1.15 else 'MISSED'})"
        )
        if not args.no_previous:
            print(f"previous default / default: {t['previous default'] / t['default']:.2f}x")
        if not args.no_bf16:
            step = t["torch.optim.Muon step"] / t["default"]
            print(f"torch.optim.Muon step / default: {step:.2f}x")
        floor = floor_seconds(shape, t[GEMM])
        summary.append((spec, picked, t, err, floor))
    print("\n## Newton-Schulz at the FLOP limit: the default vs torch's and vs the FLOP floor\n")
    print(
        "| shape | default runs | default ms | torch NS bf16 ms | torch NS / default | "
        "torch NS fp32 / default | floor ms | default / floor | error default | error torch |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for spec, picked, t, err, floor in summary:
        d, tb = t["default"], t.get("torch NS bf16")
        bf = ("—", "—", "—") if tb is None else (f"{tb * 1e3:.1f}", f"{tb / d:.2f}x", "")
        eb = err.get("torch NS bf16", err["torch NS fp32"])
        print(
            f"| {spec} | {picked} | {d * 1e3:.1f} | {bf[0]} | {bf[1]} | "
            f"{t['torch NS fp32'] / d:.2f}x | {floor * 1e3:.1f} | "
            f"{d / floor:.2f}x | {err['default']:.4f} | {eb:.4f} |"
        )


if __name__ == "__main__":
    main()
