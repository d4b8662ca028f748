"""quack's `gemm_symmetric` (`pip install dmuon_fn[quack]`, imported on first use) as a sym_mm
kernel on sm_90+, its operands prepared as the own kernel's (`_cuda.prepare`). quack compiles
and caches its own kernels (`$QUACK_CACHE_DIR`, default a per-user temp directory).
"""

from __future__ import annotations

import functools

from torch import Tensor

from ._cuda import Operands, cuda_check, import_error


@functools.cache
def _import_error() -> str:
    return import_error("quack", "quack", "quack.gemm_interface", "gemm_symmetric")


def available(device) -> tuple[bool, str]:
    why = cuda_check(device, (9, 0)) or _import_error()
    return not why, why


def triangle(ops: Operands, alpha: float, beta: float) -> Tensor:
    """`_cuda.tensor_core`'s triangle through quack, on an sm_90+ device."""
    from quack.gemm_interface import gemm_symmetric

    beta = float(beta) if ops.C is not None else 0.0
    return gemm_symmetric(ops.P, ops.B, C=ops.C, alpha=float(alpha), beta=beta)
