"""What the CUDA triangle kernels share (torch only): device and package checks, operands padded
to multiples of 8 elements on 16-byte aligned bases (proofs/custom_ops_notes.md); and quack's
kernel (`pip install dmuon_fn[quack]`; quack caches its compiles in `$QUACK_CACHE_DIR`)."""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .cpu import full_mm


def target_arch(device: torch.device) -> str:
    """The compile target of `device`, as CuTe DSL names it: sm_80, sm_86, sm_90a, sm_100a."""
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}{'a' if major >= 9 else ''}"


def cuda_check(device: torch.device, min_cap: tuple[int, int]) -> str:
    """'' when `device` is a CUDA device of at least `min_cap`, else why not."""
    if device.type != "cuda":
        return f"runs on cuda only, not {device.type}"
    if not torch.cuda.is_available():
        return "CUDA is not available in this process"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) >= min_cap:
        return ""
    return f"needs compute capability >= {min_cap[0]}.{min_cap[1]}, this device has {major}.{minor}"


def import_error(package: str, extra: str, module: str, attr: str = "__name__") -> str:
    """'' when `module` (and its `attr`) imports, else why not and how to install `package`."""
    try:
        getattr(importlib.import_module(module), attr)
    except Exception as e:
        why = f"{package} is not importable ({type(e).__name__}: {e})"
        return f"{why}; install it with `pip install dmuon_fn[{extra}]`"
    return ""


class Operands(NamedTuple):
    """P: (L, n8, k8) row-major. B: (L, k8, n8) with B.mT row-major (q_k_major) or B row-major.
    C: (L, n8, n8) row-major or None. n8, k8: n, k rounded up to multiples of 8."""

    P: Tensor
    B: Tensor
    q_k_major: bool
    C: Tensor | None
    n: int
    n8: int
    k8: int


def _aligned(t: Tensor) -> bool:
    return t.data_ptr() % 16 == 0


def _row_major(t: Tensor) -> Tensor:
    """t itself when row-major and 16-byte aligned, else a fresh (aligned) contiguous copy."""
    if t.is_contiguous() and _aligned(t):
        return t
    return t.clone(memory_format=torch.contiguous_format)


def prepare(A: Tensor, B: Tensor, C: Tensor | None) -> Operands:
    """A: (..., n, k), B: (..., k, n), C: (..., n, n) or None -> operands, batch flattened."""
    n, k = A.shape[-2], A.shape[-1]
    A3, B3 = A.reshape(-1, n, k), B.reshape(-1, k, n)
    C3 = None if C is None else C.reshape(-1, n, n)
    n8, k8 = -(-n // 8) * 8, -(-k // 8) * 8
    if (n8, k8) != (n, k):
        P = F.pad(A3, (0, k8 - k, 0, n8 - n))
        Bt = F.pad(B3.mT, (0, k8 - k, 0, n8 - n))
        Cp = None if C3 is None else F.pad(C3, (0, n8 - n, 0, n8 - n))
        return Operands(P, Bt.mT, True, Cp, n, n8, k8)
    P = _row_major(A3)
    Bt = B3.mT
    if Bt.is_contiguous() and _aligned(Bt):
        Bop, k_major = B3, True  # SYRK: B = A.mT, Q = A
    elif B3.is_contiguous() and _aligned(B3):
        Bop, k_major = B3, False  # a row-major (k, n) operand, read N-major
    else:
        Bop, k_major = _row_major(Bt).mT, True
    return Operands(P, Bop, k_major, None if C3 is None else _row_major(C3), n, n8, k8)


def finish(D: Tensor, ops: Operands, lead: tuple[int, ...]) -> Tensor:
    """The (L, n8, n8) kernel output as (..., n, n), cropping any padding."""
    if ops.n8 != ops.n:
        D = D[:, : ops.n, : ops.n].contiguous()
    return D.reshape(*lead, ops.n, ops.n)


def tensor_core(triangle: Callable[[Operands, float, float], Tensor]):
    """A sym_mm that runs `triangle(ops, alpha, beta)` -> (L, n8, n8) on `prepare`d fp16/bf16
    operands (ops.C None when beta = 0); `full_mm` for other dtypes, empty shapes, alpha = 0."""

    def sym_mm(A: Tensor, B: Tensor, C: Tensor | None, alpha: float, beta: float) -> Tensor:
        if A.dtype not in (torch.float16, torch.bfloat16) or A.numel() == 0 or alpha == 0.0:
            return full_mm(A, B, C, alpha, beta)
        ops = prepare(A, B, C if beta != 0.0 else None)
        return finish(triangle(ops, alpha, beta), ops, A.shape[:-2])

    return sym_mm


@functools.cache
def quack_import_error() -> str:
    return import_error("quack", "quack", "quack.gemm_interface", "gemm_symmetric")


def quack_available(device: torch.device) -> tuple[bool, str]:
    why = cuda_check(device, (9, 0)) or quack_import_error()
    return not why, why


def quack_triangle(ops: Operands, alpha: float, beta: float) -> Tensor:
    """`tensor_core`'s triangle through quack's gemm_symmetric, on an sm_90+ device."""
    from quack.gemm_interface import gemm_symmetric

    beta = float(beta) if ops.C is not None else 0.0
    return gemm_symmetric(ops.P, ops.B, C=ops.C, alpha=float(alpha), beta=beta)
