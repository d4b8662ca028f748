"""SYRK kernels behind `dmuon::syrk` and NS steps, data in `KERNELS`, picked by `resolve_kernel`.

`sym_mm(A, B, C, alpha, beta)` = alpha·A·B + beta·C in A's dtype, for A: (..., n, k), B: (..., k, n)
with A·B symmetric (B = Aᵀ, or commuting symmetric matrices), C: (..., n, n) symmetric or None:
exactly symmetric where a kernel mirrors a triangle, to rounding where one GEMM computes it."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from . import cute
from ._cuda import quack_available, quack_triangle, tensor_core
from .cpu import cpu_blocked, cpu_strips, full_mm

ENV_VAR = "DMUON_NS_KERNEL"


SymMM = Callable[[Tensor, Tensor, Tensor | None, float, float], Tensor]


@dataclass(frozen=True)
class Kernel:
    """A symmetric-product kernel: `name` is what `kernel=` and $DMUON_NS_KERNEL accept,
    `description` what `get_ns_backend()` prints, `available(device)` -> (ok, why not)."""

    name: str
    device_types: tuple[str, ...]
    description: str
    sym_mm: SymMM
    available: Callable[[torch.device], tuple[bool, str]]


def _on(*types: str) -> Callable[[torch.device], tuple[bool, str]]:
    def check(device: torch.device) -> tuple[bool, str]:
        ok = device.type in types
        return ok, "" if ok else f"runs on {'/'.join(types)} only, not {device.type}"

    return check


KERNELS: dict[str, Kernel] = {k.name: k for k in (
    Kernel("cpu_syrk", ("cpu",), "blocked lower-triangle GEMM strips", cpu_blocked, _on("cpu")),
    Kernel("quack", ("cuda",), "quack gemm_symmetric triangle SYRK; fp32/fp64 via cuBLAS",
           tensor_core(quack_triangle), quack_available),
    Kernel("cute_sm80", ("cuda",), "CuTe DSL triangle SYRK; fp32/fp64 via cuBLAS",
           tensor_core(cute.triangle), cute.cute_available),
    Kernel("cublas", ("cuda",), "universal fallback, full GEMM", full_mm, _on("cuda")),
    Kernel("torch_mm", ("cpu", "cuda", "meta"),
           "full GEMM through torch.matmul, no symmetry saving", full_mm, lambda d: (True, "")),
)}  # fmt: skip

# Per device type, the first available kernel wins (quack needs sm_90+, CuTe sm_80+).
_AUTO_LADDER = {"cpu": ("cpu_syrk",), "cuda": ("quack", "cute_sm80", "cublas")}


def kernel_names() -> list[str]:
    return sorted(KERNELS)


_CUDA_TRIANGLE_FROM: dict[int, float] = {}  # per CUDA device index; see set_cuda_triangle_rows


def set_cuda_triangle_rows(index: int, rows: float) -> None:
    """Install CUDA device `index`'s rule: `auto` runs its triangle kernel (not one cuBLAS GEMM)
    from `rows` rows (inf: never). Explicit kernels ignore it."""
    if not rows >= 0:
        raise ValueError(f"triangle rows must be >= 0 (inf: never), got {rows!r}")
    _CUDA_TRIANGLE_FROM[index] = float(rows)


def cuda_triangle_rows(index: int) -> float | None:
    """The installed rule of CUDA device `index` (None: not decided yet)."""
    return _CUDA_TRIANGLE_FROM.get(index)


def _index(device: torch.device) -> int | None:
    """A CUDA device's index (the current device for a bare "cuda"); else the device's own."""
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        return torch.cuda.current_device()
    return device.index


def auto_kernel(device: torch.device | str) -> Kernel:
    """The first available kernel of the device type's auto ladder ($DMUON_NS_KERNEL aside)."""
    device = torch.device(device)
    return KERNELS[_auto(device.type, _index(device))]


def resolve_kernel(name: str | None, device: torch.device | str, rows: int | None = None) -> Kernel:
    """The kernel that will run on `device`: explicit `name` > $DMUON_NS_KERNEL > auto ladder, on
    CUDA cuBLAS below `set_cuda_triangle_rows`'s rule for products of `rows` rows. ValueError for
    an unknown name, RuntimeError for a kernel that cannot run here (never replaced by another)."""
    device = torch.device(device)
    explicit = name not in (None, "auto")
    requested = name if explicit else os.environ.get(ENV_VAR) or "auto"
    source = "kernel=" if explicit else f"${ENV_VAR}"
    if requested == "auto":
        kernel = auto_kernel(device)
        triangle = device.type == "cuda" and kernel.sym_mm is not full_mm
        if triangle and rows is not None and rows < _CUDA_TRIANGLE_FROM.get(_index(device), 0):
            return KERNELS["cublas"]
        return kernel
    if requested not in KERNELS:
        valid = ", ".join(["auto", *kernel_names()])
        raise ValueError(f"unknown NS kernel {requested!r} (from {source}); valid kernels: {valid}")
    kernel = KERNELS[requested]
    ok, why = kernel.available(device)
    if not ok:
        raise RuntimeError(f"NS kernel {requested!r} (from {source}) cannot run here: {why}")
    return kernel


@functools.cache
def _auto(device_type: str, index: int | None) -> str:
    device, ladder = torch.device(device_type, index), _AUTO_LADDER.get(device_type, ())
    return next((k for k in ladder if KERNELS[k].available(device)[0]), "torch_mm")


def describe(kernel: Kernel, device: torch.device | str) -> str:
    """`kernel=<name> (<where>, <description and size rule>)`, as get_ns_backend prints it."""
    device = torch.device(device)
    cap = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    where = f"SM{cap[0]}{cap[1]}" if cap else device.type.upper()
    extra = ""
    if kernel.sym_mm is cpu_blocked:
        rule = ", ".join(f"{b} from {n} rows" for n, b in cpu_strips() if b > 1)
        extra = f": {rule}, else one GEMM" if rule else ": one GEMM at every size"
    elif device.type == "cuda" and kernel.sym_mm is not full_mm:
        rows = _CUDA_TRIANGLE_FROM.get(_index(device))
        if rows is not None and kernel is auto_kernel(device):
            extra = f"; auto: from {rows:g} rows, else cuBLAS" if rows > 0 else ""
    return f"kernel={kernel.name} ({where}, {kernel.description}{extra})"
