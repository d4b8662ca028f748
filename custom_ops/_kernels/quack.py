"""quack's `gemm_symmetric` (Tri Dao et al., `pip install quack-kernels`) as a sym_mm kernel.

For any A·B whose product is symmetric: A (L, n, k), B (L, k, n) of either major, optional C
(L, n, n), on sm_90+ (a triangular tile schedule with TMA + wgmma; tcgen05 on sm_100). quack
compiles and caches its own kernels (`$QUACK_CACHE_DIR`, default a per-user temp directory).
Optional (`pip install dmuon_fn[quack]`), imported on first use; operands go through the same
alignment/padding as the own kernel (`_cuda.prepare`).
"""

from __future__ import annotations

import functools

from torch import Tensor

from ._cuda import cuda_check, finish, prepare


@functools.cache
def _import_error() -> str:
    try:
        from quack.gemm_interface import gemm_symmetric  # noqa: F401
    except Exception as e:
        return (
            f"quack is not importable ({type(e).__name__}: {e}); "
            "install it with `pip install dmuon_fn[quack]`"
        )
    return ""


def available(device) -> tuple[bool, str]:
    why = cuda_check(device, (9, 0)) or _import_error()
    return not why, why


def sym_mm(A: Tensor, B: Tensor, C: Tensor | None, alpha: float, beta: float) -> Tensor:
    """alpha·A·B + beta·C through quack; A: (..., n, k) fp16/bf16 on an sm_90+ device."""
    from quack.gemm_interface import gemm_symmetric

    lead = A.shape[:-2]
    use_c = C is not None and beta != 0.0
    ops = prepare(A, B, C if use_c else None)
    D = gemm_symmetric(
        ops.P, ops.B, C=ops.C, alpha=float(alpha), beta=float(beta) if use_c else 0.0
    )
    return finish(D, ops, lead)
