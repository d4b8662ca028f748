"""quack's `gemm_symmetric` (`pip install dmuon_fn[quack]`, imported on first use) as a sym_mm
kernel on sm_90+, its operands prepared as the own kernel's (`_cuda.prepare`). quack compiles
and caches its own kernels (`$QUACK_CACHE_DIR`, default a per-user temp directory).
"""

from __future__ import annotations

import functools

from torch import Tensor

from ._cuda import cuda_check, finish, import_error, prepare


@functools.cache
def _import_error() -> str:
    return import_error("quack", "quack", "quack.gemm_interface", "gemm_symmetric")


def available(device) -> tuple[bool, str]:
    why = cuda_check(device, (9, 0)) or _import_error()
    return not why, why


def sym_mm(A: Tensor, B: Tensor, C: Tensor | None, alpha: float, beta: float) -> Tensor:
    """alpha·A·B + beta·C through quack; A: (..., n, k) fp16/bf16 on an sm_90+ device."""
    from quack.gemm_interface import gemm_symmetric

    use_c = C is not None and beta != 0.0
    ops = prepare(A, B, C if use_c else None)
    D = gemm_symmetric(
        ops.P, ops.B, C=ops.C, alpha=float(alpha), beta=float(beta) if use_c else 0.0
    )
    return finish(D, ops, A.shape[:-2])
