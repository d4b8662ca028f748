"""The own CuTe DSL triangle SYRK (`cute_sm80`, sm_80+): availability and the call.

Importing this package needs neither CUDA nor nvidia-cutlass-dsl (imported on first use, once per
process). `syrk_sm80.py` is the kernel, `_tiles.py` its building blocks, `_cache.py` its compiles.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from .._cuda import cuda_check, finish, import_error, prepare, target_arch

_MAX_GRID_Z = 65535  # grid z is the batch; CUDA caps it


@functools.cache
def dsl_import_error() -> str:
    """'' when nvidia-cutlass-dsl imports, else why not."""
    return import_error("nvidia-cutlass-dsl", "cute", "cutlass.cute")


def cute_available(device: torch.device) -> tuple[bool, str]:
    why = cuda_check(device, (8, 0)) or dsl_import_error()
    return not why, why


def triangle_sym_mm(A: Tensor, B: Tensor, C: Tensor | None, alpha: float, beta: float) -> Tensor:
    """alpha·A·B + beta·C, exactly symmetric, in A's dtype; A: (..., n, k) fp16/bf16 on CUDA,
    B: (..., k, n), C: (..., n, n) symmetric or None (not empty, alpha != 0: `_tensor_core`)."""
    import cuda.bindings.driver as cuda
    import cutlass
    from cutlass import Float32, Int32
    from cutlass.cute.runtime import make_ptr

    from ._cache import get_kernel

    use_c = C is not None and beta != 0.0
    ops = prepare(A, B, C if use_c else None)
    el = {torch.float16: cutlass.Float16, torch.bfloat16: cutlass.BFloat16}[A.dtype]

    def ptr(t: Tensor):
        return make_ptr(el, t.data_ptr(), cutlass.AddressSpace.gmem, assumed_align=16)

    L = ops.P.shape[0]
    D = torch.empty((L, ops.n8, ops.n8), dtype=A.dtype, device=A.device)
    with torch.cuda.device(A.device):
        dtype = str(A.dtype).removeprefix("torch.")
        kernel = get_kernel(target_arch(A.device), dtype, ops.q_k_major, use_c)
        stream = cuda.CUstream(torch.cuda.current_stream().cuda_stream)
        for b0 in range(0, L, _MAX_GRID_Z):
            b1 = min(L, b0 + _MAX_GRID_Z)
            p, q, d = ops.P[b0:b1], ops.B[b0:b1], D[b0:b1]
            c = ops.C[b0:b1] if ops.C is not None else d
            kernel(
                ptr(p), ptr(q), ptr(c), ptr(d),
                Int32(ops.n8), Int32(ops.k8), Int32(b1 - b0),
                Float32(alpha), Float32(beta), stream,
            )  # fmt: skip
    return finish(D, ops, A.shape[:-2])
