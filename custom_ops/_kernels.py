"""SYRK kernels: the symmetric-output products behind `dmuon::syrk` and the Newton-Schulz steps.

Every kernel computes `alpha·A·B + beta·C` for a product that is known to be symmetric
(`B = Aᵀ` for SYRK, or two commuting symmetric matrices in the Gram iteration). Where it saves
FLOPs by computing only the lower block-triangle, it mirrors the off-diagonal blocks, so those
are exactly symmetric and each diagonal block is one GEMM's output, symmetric to rounding; where
one full GEMM is faster (small operands), the result is that GEMM's, symmetric to rounding. C must
be symmetric.

Kernels are plain data in `KERNELS`; which one runs is resolved per device by `resolve_kernel`:
explicit name > `DMUON_NS_KERNEL` > the device's auto ladder (evaluated once per device). Nothing
here holds a mutable "active kernel": the resolved name travels as an argument of every op call.
The CUDA tensor-core kernels live in `custom_ops.cute` and import their DSLs lazily.
"""

from __future__ import annotations

import functools
import itertools
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from . import cute
from .cute import quack_adapter

ENV_VAR = "DMUON_NS_KERNEL"

# Row strips of the CPU triangle product: ((min_rows, strips), ...), min_rows ascending; a
# product of n rows takes the strips of the last entry with min_rows <= n, and one GEMM below the
# first. Whether strips beat one GEMM, and from what size, depends on the CPU's GEMM (measured:
# 2 strips won from 256 rows on one AVX-512 machine, and lost there below 512 in fp32), so the
# table is measured per machine by dmuon_fn's dispatch (dmuon_fn/ns/_dispatch.py) and installed
# with `set_cpu_strips`; until then every product is one GEMM, the plain `A @ B`.
_CPU_STRIPS: tuple[tuple[int, int], ...] = ()
# Extra elements per row of the mirror's scratch strip (see _mirror_lower_).
_SCRATCH_PAD = 16
# Strips get at least this many rows each: thinner GEMMs lose more to overhead than they save.
MIN_STRIP_ROWS = 16


def check_cpu_strips(table) -> tuple[tuple[int, int], ...]:
    """`table` as a strip table ((min_rows, strips), ...), or ValueError naming what is wrong."""
    rows = []
    for entry in table:
        ok = isinstance(entry, tuple | list) and len(entry) == 2
        ok = ok and all(isinstance(v, int) and not isinstance(v, bool) for v in entry)
        if not (ok and entry[1] >= 1 and entry[0] >= entry[1] * MIN_STRIP_ROWS):
            raise ValueError(
                f"strip table entries are (min_rows, strips) ints with strips >= 1 and min_rows "
                f">= {MIN_STRIP_ROWS}·strips, got {entry!r} in {table!r}"
            )
        rows.append((entry[0], entry[1]))
    if any(a[0] >= b[0] for a, b in itertools.pairwise(rows)):
        raise ValueError(f"strip table min_rows must ascend strictly, got {table!r}")
    return tuple(rows)


def set_cpu_strips(table) -> None:
    """Install the CPU strip table ((min_rows, strips), ...; see `_CPU_STRIPS`).

    Process-wide (the kernel reads it when it runs, eager or compiled); every rank of a job must
    install the same table (dmuon_fn agrees on it, see dmuon_fn/ns/_dispatch.py).
    """
    global _CPU_STRIPS
    _CPU_STRIPS = check_cpu_strips(table)


def cpu_strips() -> tuple[tuple[int, int], ...]:
    """The installed CPU strip table (empty: one GEMM everywhere)."""
    return _CPU_STRIPS


def _cpu_blocks(n: int) -> int:
    blocks = 1
    for min_rows, strips in _CPU_STRIPS:
        if n >= min_rows:
            blocks = strips
    return blocks


def _as_batched(t: Tensor) -> Tensor:
    # explicit batch size: reshape(-1, ...) is ambiguous for an empty (k = 0) operand
    return t.reshape(t.shape[:-2].numel(), t.shape[-2], t.shape[-1])


def _mirror_lower_(out: Tensor, bounds: list[int]) -> Tensor:
    """Write the transpose of each strip's off-diagonal part above its diagonal block, in place.

    `bounds` are the row strips the GEMMs computed: strip [r0, r1) holds rows r0..r1 up to
    column r1, so its diagonal block is whole already (one GEMM's output, symmetric to rounding)
    and only out[r0:r1, :r0] needs its transpose written into out[:r0, r0:r1]. Symmetrizing the
    diagonal blocks as well (a masked select) doubled the mirror's cost (0.52 vs 0.22 ms at
    1024² bf16, 4 strips) for no accuracy. When n is a multiple of 128 the part is first copied
    (contiguous, fast) into a scratch buffer with a padded row stride: read column-wise, a
    power-of-two stride maps a whole column into a few cache sets, and the transposed copy
    straight out of `out` ran 3.4x slower at 1024² bf16.
    """
    n = out.shape[-1]
    conflicts = n % 128 == 0  # elsewhere the scratch copy costs more than it saves (n = 1000)
    scratch = None
    if conflicts:  # one buffer for every strip: the tallest strip by the widest part
        rows = max(r1 - r0 for r0, r1 in itertools.pairwise(bounds))
        scratch = out.new_empty((*out.shape[:-2], rows, bounds[-2] + _SCRATCH_PAD))
    for r0, r1 in itertools.pairwise(bounds[1:]):
        part = out[..., r0:r1, :r0]
        if scratch is not None:
            part = scratch[..., : r1 - r0, :r0].copy_(part)
        out[..., :r0, r0:r1].copy_(part.mT)
    return out


def _strip_bounds(n: int, blocks: int) -> list[int]:
    return [(i * n) // blocks for i in range(blocks + 1)]


def triangle_product(
    A: Tensor, B: Tensor, C: Tensor | None, alpha: float, beta: float, blocks: int
) -> Tensor:
    """alpha·A·B + beta·C: the lower block-triangle by row strips, the blocks left of each
    diagonal block mirrored above it (exactly symmetric there; the diagonal blocks, like a
    single GEMM with one strip, are symmetric to rounding).

    Strip i computes rows [r0, r1) against columns [0, r1): blocks·(blocks+1)/2 of blocks² tiles,
    i.e. (blocks+1)/(2·blocks) of the full product's FLOPs, in `blocks` large GEMMs. Lower strips
    ran 2-7% faster than upper ones (columns [r0, n)) on an AVX-512 CPU at 1024 rows.
    """
    lead = A.shape[:-2]
    n = A.shape[-2]
    if alpha == 0.0:
        # torch 2.13's CPU bf16 baddbmm returns garbage for alpha=0; the product is not needed.
        out = torch.zeros((*lead, n, n), dtype=A.dtype, device=A.device)
        if C is not None and beta != 0.0:
            out = beta * C.triu()
            out = out + out.triu(1).mT
        return out
    A3, B3 = _as_batched(A), _as_batched(B)
    C3 = _as_batched(C) if C is not None and beta != 0.0 else None
    out = torch.empty(A3.shape[0], n, n, dtype=A.dtype, device=A.device)
    if blocks == 1:
        # One GEMM computes both triangles: symmetric to rounding, and mirroring would cost
        # ~1 ns per element (a third of a 768² bf16 GEMM), so it is left as computed.
        if A3.shape[0] > 1:
            _gemm(A3, B3, C3, alpha, beta, out)
        else:
            _gemm(A3[0], B3[0], None if C3 is None else C3[0], alpha, beta, out[0])
        return out.reshape(*lead, n, n)
    # Strips go through 2-D GEMMs: bmm on a sliced transposed operand copies it (measured 2.3x
    # slower at 1024×4096); BLAS takes the 2-D view as it is.
    bounds = _strip_bounds(n, blocks)
    for i in range(A3.shape[0]):
        for r0, r1 in itertools.pairwise(bounds):
            c = None if C3 is None else C3[i, r0:r1, :r1]
            _gemm(A3[i, r0:r1, :], B3[i, :, :r1], c, alpha, beta, out[i, r0:r1, :r1])
    _mirror_lower_(out, bounds)
    return out.reshape(*lead, n, n)


def _gemm(a: Tensor, b: Tensor, c: Tensor | None, alpha: float, beta: float, out: Tensor) -> None:
    """out ← alpha·a·b + beta·c (2-D or 3-D), the add inside the GEMM's fp32 accumulation."""
    mm, addmm = (torch.mm, torch.addmm) if a.dim() == 2 else (torch.bmm, torch.baddbmm)
    if c is not None:
        addmm(c, a, b, beta=beta, alpha=alpha, out=out)
    else:
        mm(a, b, out=out)
        if alpha != 1.0:
            out.mul_(alpha)


def cpu_blocked(A: Tensor, B: Tensor, C: Tensor | None, alpha: float, beta: float) -> Tensor:
    return triangle_product(A, B, C, alpha, beta, _cpu_blocks(A.shape[-2]))


def full_mm(A: Tensor, B: Tensor, C: Tensor | None, alpha: float, beta: float) -> Tensor:
    """The whole product with one GEMM (no FLOP saving), symmetric to rounding."""
    return triangle_product(A, B, C, alpha, beta, 1)


def _tensor_core(triangle: Callable[..., Tensor]) -> Callable[..., Tensor]:
    """A tensor-core triangle kernel for fp16/bf16 operands; fp32/fp64 operands (which these
    kernels do not take), empty shapes and alpha = 0 go through one cuBLAS GEMM (`full_mm`)."""

    def sym_mm(A: Tensor, B: Tensor, C: Tensor | None, alpha: float, beta: float) -> Tensor:
        if A.dtype in (torch.float16, torch.bfloat16) and A.numel() > 0 and alpha != 0.0:
            return triangle(A, B, C, alpha, beta)
        return full_mm(A, B, C, alpha, beta)

    return sym_mm


@dataclass(frozen=True)
class Kernel:
    """A symmetric-product kernel.

    name: what `kernel=` and `DMUON_NS_KERNEL` accept.
    device_types: device types it runs on.
    description: what `get_ns_backend()` prints about it.
    sym_mm: (A, B, C, alpha, beta) -> alpha·A·B + beta·C, symmetric.
    available: device -> (ok, reason when not ok).
    """

    name: str
    device_types: tuple[str, ...]
    description: str
    sym_mm: Callable[[Tensor, Tensor, Tensor | None, float, float], Tensor]
    available: Callable[[torch.device], tuple[bool, str]]


def _on(*types: str) -> Callable[[torch.device], tuple[bool, str]]:
    def check(device: torch.device) -> tuple[bool, str]:
        if device.type in types:
            return True, ""
        return False, f"runs on {'/'.join(types)} only, not {device.type}"

    return check


def _cuda_arch(device: torch.device) -> str:
    major, minor = torch.cuda.get_device_capability(device)
    return f"SM{major}{minor}"


KERNELS: dict[str, Kernel] = {
    k.name: k
    for k in (
        Kernel(
            "cpu_syrk",
            ("cpu",),
            "blocked lower-triangle GEMM strips",
            cpu_blocked,
            _on("cpu"),
        ),
        Kernel(
            "quack",
            ("cuda",),
            "quack gemm_symmetric triangle SYRK; fp32/fp64 via cuBLAS",
            _tensor_core(quack_adapter.sym_mm),
            quack_adapter.available,
        ),
        Kernel(
            "cute_sm80",
            ("cuda",),
            "CuTe DSL triangle SYRK; fp32/fp64 via cuBLAS",
            _tensor_core(cute.triangle_sym_mm),
            cute.cute_available,
        ),
        Kernel(
            "cublas",
            ("cuda",),
            "universal fallback, full GEMM",
            full_mm,
            _on("cuda"),
        ),
        Kernel(
            "torch_mm",
            ("cpu", "cuda", "meta"),
            "full GEMM through torch.matmul, no symmetry saving",
            full_mm,
            lambda device: (True, ""),
        ),
    )
}

# The auto ladder per device type: the first available kernel wins (quack needs sm_90+, the
# own CuTe kernel sm_80+; cuBLAS runs everywhere).
_AUTO_LADDER: dict[str, tuple[str, ...]] = {
    "cpu": ("cpu_syrk",),
    "cuda": ("quack", "cute_sm80", "cublas"),
}


def kernel_names() -> list[str]:
    return sorted(KERNELS)


# Per CUDA device index: the rows from which the auto ladder's tensor-core triangle kernel
# beats one cuBLAS GEMM (inf: at no size), installed by dmuon_fn's dispatch, which measures it.
# Below it `auto` runs cuBLAS: a triangle kernel's fixed launch cost (~0.3 ms a call through
# quack on an H200) exceeds the FLOPs it saves on small matrices. Explicit kernels ignore it.
_CUDA_TRIANGLE_FROM: dict[int, float] = {}


def set_cuda_triangle_rows(index: int, rows: float) -> None:
    """Install CUDA device `index`'s rule: `auto` runs its triangle kernel from `rows` rows."""
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
    """The kernel that will run on `device`: explicit `name` > $DMUON_NS_KERNEL > auto ladder.

    rows: the symmetric products' size (the iterate's short side); with it, `auto` on a CUDA
    device runs cuBLAS below the installed triangle rule (`set_cuda_triangle_rows`).
    Raises ValueError for an unknown name and RuntimeError for a known kernel that cannot run
    on this device; a requested kernel is never silently replaced by another.
    """
    device = torch.device(device)
    requested = name if name not in (None, "auto") else os.environ.get(ENV_VAR) or None
    source = "kernel=" if name not in (None, "auto") else f"${ENV_VAR}"
    if requested is None or requested == "auto":
        kernel = auto_kernel(device)
        tensor_core = device.type == "cuda" and kernel.sym_mm is not full_mm
        if tensor_core and rows is not None and rows < _CUDA_TRIANGLE_FROM.get(_index(device), 0):
            return KERNELS["cublas"]
        return kernel
    if requested not in KERNELS:
        raise ValueError(
            f"unknown NS kernel {requested!r} (from {source}); valid kernels: "
            f"{', '.join(['auto', *kernel_names()])}"
        )
    kernel = KERNELS[requested]
    ok, why = kernel.available(device)
    if not ok:
        raise RuntimeError(f"NS kernel {requested!r} (from {source}) cannot run here: {why}")
    return kernel


@functools.cache
def _auto(device_type: str, index: int | None) -> str:
    """The first available kernel of the device's ladder; capability and installed packages
    do not change within a process, so this runs once per device."""
    device = torch.device(device_type, index)
    for candidate in _AUTO_LADDER.get(device_type, ("torch_mm",)):
        if KERNELS[candidate].available(device)[0]:
            return candidate
    return "torch_mm"


def describe(kernel: Kernel, device: torch.device | str) -> str:
    device = torch.device(device)
    where = _cuda_arch(device) if device.type == "cuda" else device.type.upper()
    extra = ""
    if kernel.sym_mm is cpu_blocked:
        rule = ", ".join(f"{b} from {n} rows" for n, b in _CPU_STRIPS if b > 1)
        extra = f": {rule}, else one GEMM" if rule else ": one GEMM at every size"
    elif device.type == "cuda" and kernel.sym_mm is not full_mm:
        rows = _CUDA_TRIANGLE_FROM.get(_index(device))
        if rows is not None and kernel is auto_kernel(device):
            extra = f"; auto: from {rows:g} rows, else cuBLAS" if rows > 0 else ""
    return f"kernel={kernel.name} ({where}, {kernel.description}{extra})"
