"""How a CPU's Newton-Schulz choices are measured (`measure`) and what they are (`CpuDispatch`):
the iteration dtype, the SYRK strip table, where Gram NS starts to pay (ratio and short side);
the choose_* rules and the race they read (proofs/ns_notes.md, proofs/dispatch.md). The
dispatch module caches, agrees on and serves the result."""

from __future__ import annotations

import contextlib
import math
import platform
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

import custom_ops

from ._cost import GRAM_MIN_SHORT, default_restarts
from ._iteration import gram, normalize, schedule, standard

BF16_WIN = 1.2  # bf16 iterates round more than fp32: take them only for a clear speed-up
STRIP_WIN = 0.95  # strips must save 5% over one GEMM (whose result is the plain product)
REPS = 3
GEMM_SIZE = 512
STRIP_SIZES = (256, 512, 1024)
STRIP_COUNTS = (1, 2, 4, 8)
PROBE_SHORT = 512
PROBE_ASPECTS = (1.5, 2.0, 2.5, 3.0, 4.0)
PROBE_SHORTS = (64, 128, 256)  # below PROBE_SHORT, at the widest probe aspect: where Gram pays
TRIANGLE_SIZES = (1024, 2048, 4096, 8192)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# Flags that mean native bf16 dot products: x86 AVX-512 BF16 and AMX; Arm FEAT_BF16 (and SVE's).
BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16", "svebf16"})


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
    return bool(flags & BF16_FLAGS) if flags else None


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
    return t_bf16 * BF16_WIN <= t_fp32


def choose_aspect(times: Mapping[float, tuple[float, float]]) -> float:
    """The smallest key from which the challenger beat the incumbent at every key (times[key] =
    (incumbent, challenger) seconds, e.g. (standard, gram) per aspect); inf if none."""
    won = math.inf
    for k in sorted(times, reverse=True):
        if times[k][1] >= times[k][0]:
            break
        won = k
    return won


def _start(sizes: Sequence[float], n: float) -> float:
    """Where a choice measured at size n of the sorted `sizes` starts (proofs/ns_notes.md)."""
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
            table.append((max(round(_start(sizes, n)), blocks * custom_ops.MIN_STRIP_ROWS), blocks))
    return tuple(table)


def choose_rows(times: Mapping[int, tuple[float, float]]) -> float:
    """Rows from which a challenger runs (inf: never); times[n] = (incumbent, challenger) at n
    rows: e.g. (one GEMM, the triangle kernel), (standard NS, Gram NS)."""
    n = choose_aspect(times)
    return n if math.isinf(n) else float(round(_start(sorted(times), n)))


@dataclass(frozen=True)
class CpuDispatch:  # the CPU's Newton-Schulz choices
    dtype: torch.dtype  # float32 or bfloat16
    gram_min_aspect: float  # `method="auto"` runs Gram NS from this long/short ratio (inf: never)
    strips: tuple[tuple[int, int], ...]  # the CPU SYRK's strip table, ((min_rows, strips), ...)
    why: str  # the reason for the dtype, as `get_ns_backend()` prints it
    source: str = "measured"  # or "cache", "rank 0"
    gram_min_short: int = GRAM_MIN_SHORT  # and from this short side (below it standard NS wins)

    def to_json(self) -> dict:
        aspect = None if math.isinf(self.gram_min_aspect) else self.gram_min_aspect
        strips = [list(s) for s in self.strips]
        return dict(
            dtype=str(self.dtype)[6:],
            gram_min_aspect=aspect,
            gram_min_short=self.gram_min_short,
            strips=strips,
            why=self.why,
        )

    @classmethod
    def from_json(cls, d: Mapping, source: str) -> CpuDispatch:
        """Parse and check a cache file's or rank 0's record; ValueError if it is not one."""
        try:
            dtype = _DTYPES[d["dtype"]]
            aspect = math.inf if d["gram_min_aspect"] is None else float(d["gram_min_aspect"])
            strips = custom_ops.check_cpu_strips([tuple(s) for s in d["strips"]])
            why, short = d["why"], d["gram_min_short"]
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"not a CPU dispatch record: {e}") from e
        whole = isinstance(short, int) and not isinstance(short, bool)
        if not (
            aspect >= 1.0 and whole and short >= GRAM_MIN_SHORT and isinstance(why, str) and why
        ):
            raise ValueError(f"not a CPU dispatch record: {dict(d)!r}")
        return cls(dtype, aspect, strips, why, source, short)


def spin_up(seconds: float = 0.3) -> None:
    """Run fp32 and bf16 GEMMs for `seconds`: a CPU's first GEMMs after idle can run at a
    fraction of its rate (an Intel Xeon with AMX: 0.4-0.8 TFLOP/s in bf16 for the first few
    calls, then 0.9, or 2.2 once), which would charge whichever candidate a race runs first."""
    a = torch.randn(GEMM_SIZE, GEMM_SIZE, dtype=torch.float32, device="cpu")
    b, end = a.bfloat16(), time.perf_counter() + seconds
    while time.perf_counter() < end:
        a @ a
        b @ b


def _gemm_times() -> tuple[float, float]:
    """(fp32, bf16) seconds of one GEMM_SIZE³ GEMM (bf16 timed no more once 4x slower)."""
    a = torch.randn(GEMM_SIZE, GEMM_SIZE, dtype=torch.float32, device="cpu")
    t32 = race({"fp32": lambda: a @ a})["fp32"]
    b = a.bfloat16()
    return t32, race({"bf16": lambda: b @ b}, limit=4 * t32)["bf16"]


def _strip_times(dtype: torch.dtype) -> dict[int, dict[int, float]]:
    out, tri = {}, custom_ops.triangle_product
    for n in STRIP_SIZES:
        A = torch.randn(n, n, dtype=torch.float32, device="cpu").to(dtype)
        out[n] = race({b: (lambda A=A, b=b: tri(A, A.mT, None, 1.0, 0.0, b)) for b in STRIP_COUNTS})
    return out


def _form_times(dtype: torch.dtype, short: int, aspect: float) -> tuple[float, float]:
    """(standard, Gram) NS seconds on a short×(aspect·short) matrix in `dtype`."""
    rows, restarts = schedule("polar_express", 5), frozenset(default_restarts(5))
    G = torch.randn(short, round(aspect * short), dtype=torch.float32, device="cpu")
    X = normalize(G, 1e-7, dtype)
    runs = {"standard": lambda: standard(X, rows, "cpu_syrk")}
    runs["gram"] = lambda: gram(X.clone(), rows, restarts, "cpu_syrk")
    t = race(runs, 2 * REPS)  # close races at a shared machine's noise: more runs
    return t["standard"], t["gram"]


def _method_times(dtype: torch.dtype) -> dict[float, tuple[float, float]]:
    return {a: _form_times(dtype, PROBE_SHORT, a) for a in PROBE_ASPECTS}


def _short_times(dtype: torch.dtype, widest: tuple[float, float]) -> dict[int, tuple[float, float]]:
    """(standard, Gram) seconds at the widest probe aspect per short side of PROBE_SHORTS, and
    `widest` (PROBE_SHORT's, already measured)."""
    out = {n: _form_times(dtype, n, PROBE_ASPECTS[-1]) for n in PROBE_SHORTS}
    return {**out, PROBE_SHORT: widest}


def choose_short(times: Mapping[int, tuple[float, float]]) -> int:
    """The short side from which Gram NS runs (`choose_rows` of (standard, Gram) times), never
    below GRAM_MIN_SHORT; inf (Gram never won) leaves the aspect rule to say never."""
    rows = choose_rows(times)
    return GRAM_MIN_SHORT if math.isinf(rows) else max(int(rows), GRAM_MIN_SHORT)


def measure(flags: frozenset[str] | None = None) -> CpuDispatch:
    """Decide the CPU's choices now (proofs/ns_notes.md); installs the strip table it finds."""
    flags = cpu_flags() if flags is None else flags
    cap = torch.backends.cpu.get_cpu_capability()
    if native_bf16(flags) is False:
        dtype, why = torch.float32, f"no native bf16 matmul: {cap}"
    else:
        spin_up()
        t32, t16 = _gemm_times()
        dtype = torch.bfloat16 if choose_dtype(t32, t16) else torch.float32
        ratio = f"{t32 / t16:.2g}x faster" if t16 < t32 else f"{t16 / t32:.2g}x slower"
        why = f"bf16 GEMM measured {ratio} than fp32 ({cap})"
    with torch.no_grad():
        strips = choose_strips(_strip_times(dtype))
        custom_ops.set_cpu_strips(strips)
        by_aspect = _method_times(dtype)
        aspect = choose_aspect(by_aspect)
        short = choose_short(_short_times(dtype, by_aspect[PROBE_ASPECTS[-1]]))
    return CpuDispatch(dtype, aspect, strips, why, gram_min_short=short)
