"""What the dispatch (`_dispatch.py`) reads off the machine: the CPU's identity and flags, timing
races, and the pure rules that turn times into choices (why: proofs/ns_notes.md)."""

from __future__ import annotations

import contextlib
import math
import os
import platform
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch

import custom_ops

FORMAT = 1  # of the dispatch cache files and of the identity; bump when the procedure changes
BF16_WIN = 1.2  # bf16 iterates round more than fp32: take them only for a clear speed-up
STRIP_WIN = 0.95  # strips must save 5% over one GEMM (whose result is the plain product)
REPS = 3
# Flags that mean native bf16 dot products: x86 AVX-512 BF16 and AMX; Arm FEAT_BF16 (and SVE's).
_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16", "svebf16"})
# Flags that move GEMM speed, kept in the identity.
_KEY_FLAGS = _BF16_FLAGS | {"avx2", "fma", "avx512f", "avx512_vnni", "amx_tile", "asimd", "sve"}


def _cpuinfo(*keys: str) -> str | None:
    """The value of the first /proc/cpuinfo line keyed by one of `keys` (None: none, unreadable)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in keys:
                return value
    return None


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags ("flags" on x86, "Features" on Arm); empty if unreadable."""
    return frozenset((_cpuinfo("flags", "Features") or "").split())


def cpu_model() -> str:
    model = _cpuinfo("model name")
    return model.strip() if model is not None else platform.processor() or platform.machine()


def native_bf16(flags: frozenset[str]) -> bool | None:
    """Whether the flags show native bf16 matmul (None: no flags to tell, so measure)."""
    return bool(flags & _BF16_FLAGS) if flags else None


def identity() -> dict:
    """What the cached choice depends on; a different identity is measured afresh."""
    return {
        "format": FORMAT,
        "cpu": cpu_model(),
        "flags": sorted(cpu_flags() & _KEY_FLAGS),
        "capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "onednn_max_cpu_isa": os.environ.get("ONEDNN_MAX_CPU_ISA")
        or os.environ.get("DNNL_MAX_CPU_ISA", ""),
    }


def wall_clock(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def cuda_clock(fn: Callable[[], object]) -> float:
    """Seconds of fn's work on the current CUDA stream, by CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def race(
    candidates: Mapping[object, Callable[[], object]],
    reps: int = REPS,
    *,
    clock: Callable[[Callable[[], object]], float] = wall_clock,
    limit: float = math.inf,
) -> dict:
    """Best seconds of `reps` runs per candidate after one warm-up each, round-robin; `clock(fn)`
    times one run; a candidate whose best exceeds `limit` is timed no more."""
    best = {k: math.inf for k in candidates}
    live = dict(candidates)
    for rep in range(reps + 1):
        for k, fn in list(live.items()):
            t = clock(fn)
            if rep:
                best[k] = min(best[k], t)
                if best[k] > limit:
                    del live[k]
    return best


def choose_dtype(t_fp32: float, t_bf16: float) -> bool:
    """bf16 iterates when a bf16 GEMM took at most 1/BF16_WIN of the fp32 one's time."""
    return t_bf16 * BF16_WIN <= t_fp32


def choose_aspect(times: Mapping[float, tuple[float, float]]) -> float:
    """The smallest key at which the challenger beat the incumbent there and at every larger key
    (times[key] = (incumbent, challenger) seconds, e.g. (standard, gram) per aspect); inf if it
    lost at the largest."""
    won = math.inf
    for k in sorted(times, reverse=True):
        if times[k][1] >= times[k][0]:
            break
        won = k
    return won


def _start(sizes: Sequence[float], n: float) -> float:
    """Where a choice measured at size n of the sorted `sizes` starts: the geometric midpoint to
    the next smaller size, n/√2 below the smallest."""
    i = sizes.index(n)
    return math.sqrt(n * sizes[i - 1]) if i else n / math.sqrt(2)


def choose_strips(times: Mapping[int, Mapping[int, float]]) -> tuple[tuple[int, int], ...]:
    """The strip table from times[n][strips] (strips 1: one GEMM) measured at sizes n: each
    size's fastest strip count when it beat one GEMM by STRIP_WIN, else one GEMM."""
    sizes = sorted(times)
    table: list[tuple[int, int]] = []
    for n in sizes:
        t = times[n]
        best = min(t, key=lambda b: (t[b], b))
        blocks = best if best > 1 and t[best] <= STRIP_WIN * t[1] else 1
        if blocks != (table[-1][1] if table else 1):
            start = round(_start(sizes, n))
            table.append((max(start, blocks * custom_ops.MIN_STRIP_ROWS), blocks))
    return tuple(table)


def choose_triangle_rows(times: Mapping[int, tuple[float, float]]) -> float:
    """Rows from which the triangle kernel runs (times[n] = (one GEMM, triangle) at n rows): the
    `_start` of `choose_aspect(times)`; inf if it lost at the largest."""
    n = choose_aspect(times)
    return n if math.isinf(n) else float(round(_start(sorted(times), n)))
