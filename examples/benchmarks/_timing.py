"""Side-by-side timing helpers shared by the benchmark scripts."""

from __future__ import annotations

import platform
import time
from collections.abc import Callable

import torch


def interleaved_median(fns: dict[str, Callable[[], object]], reps: int = 7) -> dict[str, float]:
    """Median seconds per call, the candidates run round-robin so drift hits all alike."""
    for fn in fns.values():
        fn()  # warm-up
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {k: sorted(v)[len(v) // 2] for k, v in times.items()}


def machine() -> str:
    return (
        f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
        f"torch {torch.__version__}, {time.strftime('%Y-%m-%d')}"
    )


def polar_error(out: torch.Tensor, G: torch.Tensor) -> float:
    """‖out − U·Vᵀ‖_F / ‖U·Vᵀ‖_F against the float64 polar factor of G."""
    U, _, Vh = torch.linalg.svd(G.double(), full_matrices=False)
    P = U @ Vh
    return ((out.double() - P).norm() / P.norm()).item()
