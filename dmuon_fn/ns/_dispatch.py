"""What Newton-Schulz runs on a device: the iteration dtype, the Gram ratio, the SYRK kernel.
A CPU's are measured once per `identity()` (`cpu_dispatch`, cached in `cache_dir()/dispatch/`,
`agree`d from rank 0); elsewhere Gram runs from GRAM_MIN_ASPECT, the dtype is bf16 on CUDA sm_80+
(fp16 below, float32 off CUDA), CUDA's triangle kernel from `cuda_triangle_rows`. Each is a
constant under torch.compile (proofs/dispatch.md); the choose_* rules: proofs/ns_notes.md."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import platform
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

import custom_ops

from ..comm._mesh import broadcast_json
from ._cost import GRAM_MIN_ASPECT, GRAM_MIN_SHORT, default_restarts
from ._iteration import gram, normalize, schedule, standard

FORMAT = 3  # of the dispatch cache files and of the identity; bump when the procedure changes
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
_log = logging.getLogger("dmuon_fn")
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


_current: CpuDispatch | None = None
# Its dtype and ratio as plain globals, for torch.compile's guards (proofs/ns_notes.md).
_DTYPE: torch.dtype | None = None
_ASPECT: float | None = None
_SHORT: int | None = None


def _read(path: Path, ident: dict) -> CpuDispatch | None:
    """The cached choice, or None unless the file holds a valid record of identity `ident`."""
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError, AttributeError):
        record = json.loads(path.read_text())
        if record.get("identity") == ident:
            return CpuDispatch.from_json(record["dispatch"], "cache")
    return None


def _load_or_measure() -> CpuDispatch:
    """The cached choice of this machine's identity, else `measure()` written to the cache."""
    ident = identity()
    digest = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:20]
    path = custom_ops.cache_dir() / "dispatch" / f"cpu-{digest}.json"
    try:
        with custom_ops.locked(path.with_suffix(".lock")):
            found = _read(path, ident)
            if found is not None:
                return found
            _log.info("dmuon_fn: measuring this CPU's Newton-Schulz dispatch once (%s)", path)
            d = measure()
            body = {"identity": ident, "dispatch": d.to_json()}
            tmp = path.with_suffix(".tmp")  # one writer at a time: the lock is held
            tmp.write_text(json.dumps(body, indent=1, sort_keys=True) + "\n")
            os.replace(tmp, path)  # readers see the old file or the new one, never half
            return d
    except OSError as e:  # an unwritable cache: measure for this process only
        _log.warning("dmuon_fn: CPU dispatch cache unusable (%s); measuring in memory", e)
        return measure()


def install(d: CpuDispatch | None) -> CpuDispatch | None:
    """Make `d` this process's CPU dispatch, strip table included; None forgets it."""
    global _current, _DTYPE, _ASPECT, _SHORT
    if d is not None:
        custom_ops.set_cpu_strips(d.strips)
    _current, _DTYPE, _ASPECT, _SHORT = (
        d,
        d and d.dtype,
        d and d.gram_min_aspect,
        d and d.gram_min_short,
    )
    return d


def cpu_dispatch() -> CpuDispatch:
    """This process's CPU choices, decided on first use (cache or measurement)."""
    if _current is None:
        with torch._C._DisableFuncTorch():  # first use may come inside vmap or grad
            install(_load_or_measure())
    return _current


def agree(group: dist.ProcessGroup | None = None) -> CpuDispatch:
    """Install group rank 0's CPU choices on every rank of `group` (one small broadcast pair)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return cpu_dispatch()
    if dist.get_rank(group) == 0:
        broadcast_json(cpu_dispatch().to_json(), 0, group)
        return _current
    return install(CpuDispatch.from_json(broadcast_json(None, 0, group), "rank 0"))


@torch.compiler.assume_constant_result
def _decide(field: str) -> torch.dtype | float | int:
    return getattr(cpu_dispatch(), field)


@torch.compiler.assume_constant_result
def _cuda_dtype(index: int) -> torch.dtype:
    return torch.bfloat16 if torch.cuda.get_device_capability(index)[0] >= 8 else torch.float16


def _cuda_index(device: torch.device) -> int:
    return torch.cuda.current_device() if device.index is None else device.index


def iteration_dtype(device: torch.device) -> torch.dtype:
    if device.type == "cpu":
        return _DTYPE if _DTYPE is not None else _decide("dtype")
    if device.type == "cuda":
        return _cuda_dtype(_cuda_index(device))
    return torch.float32


def gram_min_aspect(device: torch.device) -> float:
    """long/short from which `method="auto"` runs Gram NS on the device (inf: never)."""
    if device.type != "cpu":
        return GRAM_MIN_ASPECT
    return _ASPECT if _ASPECT is not None else _decide("gram_min_aspect")


def gram_min_short(device: torch.device) -> int:
    """The short side from which `method="auto"` runs Gram NS on the device."""
    if device.type != "cpu":
        return GRAM_MIN_SHORT
    return _SHORT if _SHORT is not None else _decide("gram_min_short")


def gram_rule(device: torch.device) -> dict[str, float]:
    """Where `method="auto"` runs Gram NS on the device, as `partition`'s keywords."""
    return {"gram_min_aspect": gram_min_aspect(device), "gram_min_short": gram_min_short(device)}


def agreed_gram(device: torch.device) -> dict[str, float]:
    """The Gram rule a job plans with (`gram_rule`): on a CPU rank 0's, `agree`d over the world."""
    if device.type != "cpu":
        return gram_rule(device)
    d = agree()
    return {"gram_min_aspect": d.gram_min_aspect, "gram_min_short": d.gram_min_short}


def dtype_reason(device: torch.device) -> str:
    if device.type == "cpu":
        return cpu_dispatch().why
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(_cuda_index(device))
        return f"{'native' if major >= 8 else 'no native'} bf16 matmul on SM{major}{minor}"
    return f"no tuned choice for {device.type}"


def setup_field(device: torch.device) -> str:
    """The device's choices as one string, for the cross-rank setup check."""
    if device.type == "cpu":
        return json.dumps(cpu_dispatch().to_json(), sort_keys=True)
    rule = f"Gram from {gram_min_aspect(device):g} and {gram_min_short(device)} rows"
    return f"{iteration_dtype(device)}, {rule}"


def cuda_triangle_rows(device: torch.device) -> float:
    """Rows from which `auto` runs the device's triangle kernel, measured on first use and held
    by custom_ops (inf: never; 0 when the ladder's pick is a plain GEMM)."""
    index = _cuda_index(device)
    rows = custom_ops.cuda_triangle_rows(index)
    if rows is not None:
        return rows
    kernel = custom_ops.auto_kernel(torch.device("cuda", index))
    if kernel.name == "cublas":
        rows = 0.0
    else:
        dtype, times = _cuda_dtype(index), {}
        fns = {"gemm": custom_ops.KERNELS["cublas"].sym_mm, "triangle": kernel.sym_mm}
        with torch.no_grad(), torch.cuda.device(index):
            for n in TRIANGLE_SIZES:
                A = torch.randn(n, n, device="cuda", dtype=dtype)
                runs = {k: (lambda f=f, A=A: f(A, A.mT, None, 1.0, 0.0)) for k, f in fns.items()}
                t = race(runs, 2 * REPS, clock=cuda_clock)
                times[n] = (t["gemm"], t["triangle"])
        rows = choose_rows(times)
        _log.info("dmuon_fn: %s from %s rows on cuda:%d (%s)", kernel.name, rows, index, times)
    custom_ops.set_cuda_triangle_rows(index, rows)
    return rows


@torch.compiler.assume_constant_result
def kernel_choice(kernel: str | None, device: torch.device, rows: int | None = None) -> str:
    """The SYRK kernel's name on `device` for `rows`-row products (constant; proofs/dispatch.md)."""
    resolved = custom_ops.resolve_kernel(kernel, device)
    if device.type != "cuda" or resolved is not custom_ops.auto_kernel(device):
        return resolved.name  # an explicit kernel, or a device without a size rule
    cuda_triangle_rows(device)  # auto's size rule, measured on first use
    return custom_ops.resolve_kernel(kernel, device, rows).name
