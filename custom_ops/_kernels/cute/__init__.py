"""The own CuTe DSL triangle SYRK (`cute_sm80`, sm_80+): availability and the call.

Importing this package needs neither CUDA nor nvidia-cutlass-dsl (imported on first use, once per
process). `syrk_sm80.py` is the kernel, `_tiles.py` its building blocks, `_cache.py` its compiles.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from .._cuda import Operands, cuda_check, import_error, target_arch

_MAX_GRID_Z = 65535  # grid z is the batch; CUDA caps it


@functools.cache
def dsl_import_error() -> str:
    """'' when nvidia-cutlass-dsl imports, else why not."""
    return import_error("nvidia-cutlass-dsl", "cute", "cutlass.cute")


def cute_available(device: torch.device) -> tuple[bool, str]:
    why = cuda_check(device, (8, 0)) or dsl_import_error()
    return not why, why


def triangle(ops: Operands, alpha: float, beta: float) -> Tensor:
    """`_cuda.tensor_core`'s triangle through the own kernel, on an sm_80+ device."""
    import cuda.bindings.driver as cuda
    import cutlass
    from cutlass import Float32, Int32
    from cutlass.cute.runtime import make_ptr

    from ._cache import get_kernel

    el = {torch.float16: cutlass.Float16, torch.bfloat16: cutlass.BFloat16}[ops.P.dtype]

    def ptr(t: Tensor):
        return make_ptr(el, t.data_ptr(), cutlass.AddressSpace.gmem, assumed_align=16)

    L, device = ops.P.shape[0], ops.P.device
    D = torch.empty((L, ops.n8, ops.n8), dtype=ops.P.dtype, device=device)
    with torch.cuda.device(device):
        dtype = str(D.dtype).removeprefix("torch.")
        kernel = get_kernel(target_arch(device), dtype, ops.q_k_major, ops.C is not None)
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
    return D
