"""What Newton-Schulz runs on a device: the iteration dtype, the Gram rule, the SYRK kernel.
A CPU's are measured once per `identity()` (`_calibrate.measure`; `cpu_dispatch`, cached in
`cache_dir()/dispatch/`, `agree`d from rank 0); elsewhere Gram runs from GRAM_MIN_ASPECT and
GRAM_MIN_SHORT, the dtype is bf16 on CUDA sm_80+ (fp16 below, float32 off CUDA), CUDA's triangle
kernel from `cuda_triangle_rows`. Each is a constant under torch.compile (proofs/dispatch.md)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
from pathlib import Path

import torch
import torch.distributed as dist

import custom_ops

from ..comm._mesh import broadcast_json
from ._calibrate import (
    BF16_FLAGS,
    REPS,
    TRIANGLE_SIZES,
    CpuDispatch,
    choose_rows,
    cpu_flags,
    cpu_model,
    cuda_clock,
    measure,
    race,
)
from ._cost import GRAM_MIN_ASPECT, GRAM_MIN_SHORT

FORMAT = 3  # of the dispatch cache files and of the identity; bump when the procedure changes
_log = logging.getLogger("dmuon_fn")
# Flags that move GEMM speed, kept in the identity.
_KEY_FLAGS = BF16_FLAGS | {"avx2", "fma", "avx512f", "avx512_vnni", "amx_tile", "asimd", "sve"}

_current: CpuDispatch | None = None
# Its choices as plain globals, for torch.compile's guards (proofs/ns_notes.md).
_DTYPE: torch.dtype | None = None
_ASPECT: float | None = None
_SHORT: int | None = None


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
    """The Gram rule a job plans with: `gram_rule` once a CPU has installed rank 0's choice
    (`agree`, over the world)."""
    if device.type == "cpu":
        agree()
    return gram_rule(device)


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
