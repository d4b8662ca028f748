"""What Newton-Schulz runs fastest here, decided from the machine, never from one machine's numbers.

Three choices depend on the CPU, not on the math:

- the iteration dtype: a bf16 GEMM runs ~2.5x faster than fp32 on a CPU with native bf16 dot
  products (AVX-512 BF16, AMX, Arm BF16) and ~100x slower on one that emulates them (AVX2);
- the aspect ratio long/short from which Gram NS beats the standard iteration;
- the CPU SYRK's strip table (custom_ops/_kernels.py, `set_cpu_strips`).

`cpu_dispatch()` decides them once per process:

    1. flags: a CPU whose flags show no native bf16 matmul iterates in float32, unmeasured;
    2. else a 512³ GEMM in fp32 and in bf16: bf16 when it runs BF16_WIN times faster;
    3. in that dtype, an n×n triangle product in one GEMM and in 2, 4, 8 strips at n = 256, 512,
       1024: a size's fastest strip count, when it beats one GEMM by STRIP_WIN, applies from
       n/√2 rows (the geometric midpoint to the next smaller size);
    4. with those strips, standard vs Gram NS on 256×(α·256) for α = 1.5, 2, 3, 4: Gram from the
       smallest α at which it is faster there and at every larger α (never if at none).

Each time is the best of REPS runs after a warm-up, candidates round-robin. It takes about a
second and is cached as JSON in `cache_dir()/dispatch/`, one file per machine identity (format,
CPU model, CPU flags, ATen's vector capability, torch version, thread count, oneDNN ISA cap). A
file whose identity, format or values do not check out is measured again and rewritten; one
process measures at a time (a lock), so ranks starting together wait and read its result.

A job must run one choice on every rank, whatever each rank's timings say: `agree(group)` sends
rank 0's choice (JSON in a uint8 tensor, dmuon_fn/comm/_exchange.py) and every rank installs it;
`dedicate_params` and `plan` call it before planning, and the setup check compares the result.

CUDA: bf16 iterates on devices with native bf16 (sm_80+), else fp16; Gram from long/short >=
GRAM_MIN_ASPECT (1.5, the Gram Newton-Schulz authors' measurement with symmetric kernels). The
auto ladder's tensor-core triangle kernel (custom_ops/_kernels.py) runs from the size at which
it beats one cuBLAS GEMM, measured once per process and device (`cuda_triangle_rows`: n×n
products at TRIANGLE_SIZES, CUDA events, the same "from the smallest size that wins there and at
every larger one" rule); below it, cuBLAS. Measured on an H200 (quack): 0.21x at 1024 rows,
0.67x at 4096, 1.52x at 8192, so a fixed rule would be wrong on one device or another.
`dtype=`, `method=`, `kernel=` and $DMUON_NS_KERNEL override every choice.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import platform
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

import custom_ops

from ..comm._exchange import broadcast_json
from ._coefficients import schedule
from ._cost import GRAM_MIN_ASPECT, default_restarts
from ._iteration import gram, normalize, standard

FORMAT = 1  # of the cache files and of the identity; bump when the procedure changes
BF16_WIN = 1.2  # bf16 iterates round more than fp32: take them only for a clear speed-up
STRIP_WIN = 0.95  # strips must save 5% over one GEMM (whose result is the plain product)
GEMM_SIZE = 512
STRIP_SIZES = (256, 512, 1024)
STRIP_COUNTS = (1, 2, 4, 8)
PROBE_SHORT = 256
PROBE_ASPECTS = (1.5, 2.0, 3.0, 4.0)
REPS = 3
# Flags that mean native bf16 dot products: x86 AVX-512 BF16 and AMX; Arm FEAT_BF16 (and SVE's).
_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16", "svebf16"})
# Flags that move GEMM speed, kept in the identity.
_KEY_FLAGS = _BF16_FLAGS | {"avx2", "fma", "avx512f", "avx512_vnni", "amx_tile", "asimd", "sve"}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_log = logging.getLogger("dmuon_fn")


@dataclass(frozen=True)
class CpuDispatch:
    """The CPU's Newton-Schulz choices.

    dtype: iteration dtype (float32 or bfloat16).
    gram_min_aspect: `method="auto"` runs Gram NS from this long/short ratio (inf: never).
    strips: the CPU SYRK's strip table, ((min_rows, strips), ...).
    why: the reason for the dtype, as `get_ns_backend()` prints it.
    source: "measured", "cache" or "rank 0" (installed by `agree`).
    """

    dtype: torch.dtype
    gram_min_aspect: float
    strips: tuple[tuple[int, int], ...]
    why: str
    source: str = "measured"

    def to_json(self) -> dict:
        aspect = None if math.isinf(self.gram_min_aspect) else self.gram_min_aspect
        return {
            "dtype": str(self.dtype)[6:],
            "gram_min_aspect": aspect,
            "strips": [list(s) for s in self.strips],
            "why": self.why,
        }

    @classmethod
    def from_json(cls, d: Mapping, source: str) -> CpuDispatch:
        """Parse and check a record (a cache file's or rank 0's); ValueError if it is not one."""
        try:
            dtype = _DTYPES[d["dtype"]]
            aspect = math.inf if d["gram_min_aspect"] is None else float(d["gram_min_aspect"])
            strips = custom_ops.check_cpu_strips([tuple(s) for s in d["strips"]])
            why = d["why"]
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"not a CPU dispatch record: {e}") from e
        if not (aspect >= 1.0 and isinstance(why, str) and why):
            raise ValueError(f"not a CPU dispatch record: {dict(d)!r}")
        return cls(dtype, aspect, strips, why, source)


# ---------------------------------------------------------------------------- the machine


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags ("flags" on x86, "Features" on Arm in /proc/cpuinfo); empty where
    they cannot be read (then nothing is decided by flags)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


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


# ---------------------------------------------------------------------------- the decisions


def choose_dtype(t_fp32: float, t_bf16: float) -> bool:
    """bf16 iterates when a bf16 GEMM took at most 1/BF16_WIN of the fp32 one's time."""
    return t_bf16 * BF16_WIN <= t_fp32


def choose_strips(times: Mapping[int, Mapping[int, float]]) -> tuple[tuple[int, int], ...]:
    """The strip table from times[n][strips] (strips 1: one GEMM) measured at sizes n."""
    sizes = sorted(times)
    table: list[tuple[int, int]] = []
    for i, n in enumerate(sizes):
        t = times[n]
        best = min(t, key=lambda b: (t[b], b))
        blocks = best if best > 1 and t[best] <= STRIP_WIN * t[1] else 1
        if blocks != (table[-1][1] if table else 1):
            start = math.sqrt(n * sizes[i - 1]) if i else n / math.sqrt(2)
            table.append((max(round(start), blocks * custom_ops.MIN_STRIP_ROWS), blocks))
    return tuple(table)


def choose_aspect(times: Mapping[float, tuple[float, float]]) -> float:
    """Gram from the smallest aspect at which it beat standard NS there and at every larger
    aspect (times[aspect] = (standard, gram)); inf if it lost at the largest."""
    aspect = math.inf
    for a in sorted(times, reverse=True):
        t_std, t_gram = times[a]
        if t_gram >= t_std:
            break
        aspect = a
    return aspect


# ---------------------------------------------------------------------------- measuring


def race(candidates: Mapping[object, Callable[[], object]], reps: int = REPS) -> dict:
    """Best seconds of `reps` runs per candidate after one warm-up each, run round-robin so a
    burst of other load hits all of them alike."""
    best = {k: math.inf for k in candidates}
    for rep in range(reps + 1):
        for k, fn in candidates.items():
            t0 = time.perf_counter()
            fn()
            if rep:
                best[k] = min(best[k], time.perf_counter() - t0)
    return best


def _gemm_times() -> tuple[float, float]:
    """(fp32, bf16) seconds of one 512³ GEMM. Emulated bf16 takes ~0.5 s a call: stop timing it
    as soon as one warm call is 4x slower than fp32."""
    a = torch.randn(GEMM_SIZE, GEMM_SIZE, dtype=torch.float32, device="cpu")
    t32 = race({"fp32": lambda: a @ a})["fp32"]
    b = a.bfloat16()
    t16 = math.inf
    for rep in range(REPS + 1):
        t0 = time.perf_counter()
        b @ b
        if rep:
            t16 = min(t16, time.perf_counter() - t0)
            if t16 > 4 * t32:
                break
    return t32, t16


def _strip_times(dtype: torch.dtype) -> dict[int, dict[int, float]]:
    out = {}
    for n in STRIP_SIZES:
        A = torch.randn(n, n, dtype=torch.float32, device="cpu").to(dtype)
        out[n] = race(
            {
                b: (lambda A=A, b=b: custom_ops.triangle_product(A, A.mT, None, 1.0, 0.0, b))
                for b in STRIP_COUNTS
            }
        )
    return out


def _method_times(dtype: torch.dtype) -> dict[float, tuple[float, float]]:
    rows = schedule("polar_express", 5)
    restarts = frozenset(default_restarts(5))
    out = {}
    for a in PROBE_ASPECTS:
        G = torch.randn(PROBE_SHORT, round(a * PROBE_SHORT), dtype=torch.float32, device="cpu")
        X = normalize(G, 1e-7, dtype)
        t = race(
            {
                "standard": lambda X=X: standard(X, rows, "cpu_syrk"),
                "gram": lambda X=X: gram(X.clone(), rows, restarts, "cpu_syrk"),
            }
        )
        out[a] = (t["standard"], t["gram"])
    return out


def measure(flags: frozenset[str] | None = None) -> CpuDispatch:
    """Decide the three choices on this CPU now (steps 1-4 of the module docstring). Installs
    the measured strip table (step 4 times NS with it)."""
    flags = cpu_flags() if flags is None else flags
    cap = torch.backends.cpu.get_cpu_capability()
    if native_bf16(flags) is False:
        dtype, why = torch.float32, f"no native bf16 matmul: {cap}"
    else:
        t32, t16 = _gemm_times()
        dtype = torch.bfloat16 if choose_dtype(t32, t16) else torch.float32
        ratio = f"{t32 / t16:.2g}x faster" if t16 < t32 else f"{t16 / t32:.2g}x slower"
        why = f"bf16 GEMM measured {ratio} than fp32 ({cap})"
    with torch.no_grad():
        strips = choose_strips(_strip_times(dtype))
        custom_ops.set_cpu_strips(strips)
        aspect = choose_aspect(_method_times(dtype))
    return CpuDispatch(dtype, aspect, strips, why)


# ---------------------------------------------------------------------------- the process's


_current: CpuDispatch | None = None
# Its dtype and ratio as plain globals: torch.compile guards on these (a graph traced before
# `agree` installs rank 0's choice recompiles with it), which it cannot on the dataclass.
_DTYPE: torch.dtype | None = None
_ASPECT: float | None = None


def _cache_file(ident: dict) -> Path:
    digest = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:20]
    return custom_ops.cache_dir() / "dispatch" / f"cpu-{digest}.json"


def _read(path: Path, ident: dict) -> CpuDispatch | None:
    """The cached choice, or None if the file is missing, unreadable, for another identity or
    format, or holds values that do not check out."""
    try:
        record = json.loads(path.read_text())
        if record.get("identity") != ident:
            return None
        return CpuDispatch.from_json(record["dispatch"], "cache")
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _write(path: Path, ident: dict, d: CpuDispatch) -> None:
    body = json.dumps({"identity": ident, "dispatch": d.to_json()}, indent=1, sort_keys=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
        f.write(body + "\n")
    os.replace(f.name, path)


def _load_or_measure() -> CpuDispatch:
    ident = identity()
    path = _cache_file(ident)
    try:
        with custom_ops.locked(path.with_suffix(".lock")):
            found = _read(path, ident)
            if found is not None:
                return found
            _log.info("dmuon_fn: measuring this CPU's Newton-Schulz dispatch once (%s)", path)
            d = measure()
            _write(path, ident, d)
            return d
    except OSError as e:  # an unwritable cache: measure for this process only
        _log.warning("dmuon_fn: CPU dispatch cache unusable (%s); measuring in memory", e)
        return measure()


def install(d: CpuDispatch | None) -> None:
    """Make `d` this process's CPU dispatch (and its strip table the SYRK's); None forgets it
    (the next use decides again)."""
    global _current, _DTYPE, _ASPECT
    if d is not None:
        custom_ops.set_cpu_strips(d.strips)
    _current, _DTYPE, _ASPECT = d, d and d.dtype, d and d.gram_min_aspect


def cpu_dispatch() -> CpuDispatch:
    """This process's CPU choices: decided on first use (cache or measurement), then fixed."""
    if _current is None:
        install(_load_or_measure())
    return _current


def agree(group: dist.ProcessGroup | None = None) -> CpuDispatch:
    """Install group rank 0's CPU choices on every rank of `group` (one small broadcast pair);
    only rank 0 resolves (measures at most once per machine)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return cpu_dispatch()
    if dist.get_rank(group) == 0:
        broadcast_json(cpu_dispatch().to_json(), 0, group)
        return _current
    d = CpuDispatch.from_json(broadcast_json(None, 0, group), "rank 0")
    install(d)
    return d


# ---------------------------------------------------------------------------- per device


# Deciding inside torch.compile: run eagerly while tracing, the result a constant of the graph.
@torch.compiler.assume_constant_result
def _decide_dtype() -> torch.dtype:
    return cpu_dispatch().dtype


@torch.compiler.assume_constant_result
def _decide_aspect() -> float:
    return cpu_dispatch().gram_min_aspect


def _cpu_dtype() -> torch.dtype:
    return _DTYPE if _DTYPE is not None else _decide_dtype()


def _cpu_aspect() -> float:
    return _ASPECT if _ASPECT is not None else _decide_aspect()


@torch.compiler.assume_constant_result
def _cuda_dtype(index: int) -> torch.dtype:
    """bf16 where tensor cores take it (sm_80+); fp16 below, where bf16 is emulated."""
    return torch.bfloat16 if torch.cuda.get_device_capability(index)[0] >= 8 else torch.float16


def _cuda_index(device: torch.device) -> int:
    return torch.cuda.current_device() if device.index is None else device.index


def iteration_dtype(device: torch.device) -> torch.dtype:
    """The device's Newton-Schulz iteration dtype (a constant under torch.compile)."""
    if device.type == "cpu":
        return _cpu_dtype()
    if device.type == "cuda":
        return _cuda_dtype(_cuda_index(device))
    return torch.float32


TRIANGLE_SIZES = (1024, 2048, 4096, 8192)


def choose_triangle_rows(times: Mapping[int, tuple[float, float]]) -> float:
    """Rows from which the triangle kernel runs (times[n] = (one GEMM, triangle) at n rows): the
    geometric midpoint below the smallest size at which it won there and at every larger size;
    inf if it lost at the largest."""
    sizes = sorted(times)
    rows = math.inf
    for i in range(len(sizes) - 1, -1, -1):
        t_gemm, t_tri = times[sizes[i]]
        if t_tri >= t_gemm:
            break
        rows = math.sqrt(sizes[i] * sizes[i - 1]) if i else sizes[i] / math.sqrt(2)
    return rows if math.isinf(rows) else float(round(rows))


def _cuda_race(candidates: Mapping[object, Callable[[], object]], reps: int = 2 * REPS) -> dict:
    """`race` timed with CUDA events: best seconds per candidate after one warm-up each (which
    compiles), round-robin, so a GPU still raising its clocks slows every candidate alike
    (timing one candidate after the other measured the first one slower)."""
    best = {k: math.inf for k in candidates}
    for rep in range(reps + 1):
        for k, fn in candidates.items():
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            if rep:
                best[k] = min(best[k], start.elapsed_time(end) / 1e3)
    return best


def cuda_triangle_rows(device: torch.device) -> float:
    """Rows from which `auto` runs the device's triangle kernel (measured on first use, then
    installed in custom_ops; inf: never; 0 when the ladder's pick is a plain GEMM)."""
    index = _cuda_index(device)
    rows = custom_ops.cuda_triangle_rows(index)
    if rows is not None:
        return rows
    kernel = custom_ops.auto_kernel(torch.device("cuda", index))
    if kernel.name == "cublas":
        rows = 0.0
    else:
        dtype = _cuda_dtype(index)
        times = {}
        with torch.no_grad(), torch.cuda.device(index):
            for n in TRIANGLE_SIZES:
                A = torch.randn(n, n, device="cuda", dtype=dtype)
                fns = {"gemm": custom_ops.KERNELS["cublas"].sym_mm, "triangle": kernel.sym_mm}
                t = _cuda_race(
                    {k: (lambda f=f, A=A: f(A, A.mT, None, 1.0, 0.0)) for k, f in fns.items()}
                )
                times[n] = (t["gemm"], t["triangle"])
        rows = choose_triangle_rows(times)
        _log.info("dmuon_fn: %s from %s rows on cuda:%d (%s)", kernel.name, rows, index, times)
    custom_ops.set_cuda_triangle_rows(index, rows)
    return rows


def dtype_reason(device: torch.device) -> str:
    """Why `iteration_dtype(device)` is what it is, for `get_ns_backend()`."""
    if device.type == "cpu":
        return cpu_dispatch().why
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(_cuda_index(device))
        return f"{'native' if major >= 8 else 'no native'} bf16 matmul on SM{major}{minor}"
    return f"no tuned choice for {device.type}"


def gram_min_aspect(device: torch.device) -> float:
    """long/short from which `method="auto"` runs Gram NS on the device (a constant under
    torch.compile; inf: never)."""
    return _cpu_aspect() if device.type == "cpu" else GRAM_MIN_ASPECT


def agreed_aspect(device: torch.device) -> float:
    """The Gram ratio a job plans with (`partition(gram_min_aspect=...)`): on a CPU, after every
    rank has installed rank 0's choices (`agree` over the world); on a GPU, GRAM_MIN_ASPECT."""
    return agree().gram_min_aspect if device.type == "cpu" else GRAM_MIN_ASPECT


def setup_field(device: torch.device) -> str:
    """The device's choices as one string, for the setup check that every rank compares."""
    if device.type == "cpu":
        return json.dumps(cpu_dispatch().to_json(), sort_keys=True)
    return f"{iteration_dtype(device)}, Gram from {gram_min_aspect(device):g}"
