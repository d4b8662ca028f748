"""dmuon::syrk — alpha·A·Aᵀ + beta·C with a symmetric result.

A: (..., n, k); C: (..., n, n) symmetric, A's dtype, or None. Returns (..., n, n) in A's dtype,
exactly symmetric where the kernel mirrors a triangle, to rounding where one GEMM computes it.
`impl`: a kernel of `custom_ops.KERNELS` ("auto": per device, honouring $DMUON_NS_KERNEL)."""

from __future__ import annotations

import torch
from torch import Tensor

from ._kernels import resolve_kernel
from ._registry import OpSpec, check_like, register_batched_vmap, register_op


def _check(A: Tensor, C: Tensor | None) -> None:
    if A.dim() < 2:
        raise ValueError(f"syrk: A must have at least 2 dims, got shape {tuple(A.shape)}")
    check_like("syrk", "C", C, (*A.shape[:-2], A.shape[-2], A.shape[-2]), A.dtype)


def syrk_math(
    A: Tensor, C: Tensor | None = None, alpha: float = 1.0, beta: float = 0.0, impl: str = "auto"
) -> Tensor:
    _check(A, C)
    return resolve_kernel(impl, A.device).sym_mm(A, A.mT, C, alpha, beta)


# the op; syrk_math is its body, which eager callers may run directly (dmuon_fn.ns._iteration)
syrk = torch.library.custom_op("dmuon::syrk", syrk_math, mutates_args=())


@syrk.register_fake
def _(A, C=None, alpha=1.0, beta=0.0, impl="auto"):
    _check(A, C)
    return A.new_empty((*A.shape[:-1], A.shape[-2]))


def _setup_context(ctx, inputs, output):
    A, C, alpha, beta, _ = inputs
    ctx.save_for_backward(A)
    ctx.alpha, ctx.beta, ctx.has_c = alpha, beta, C is not None


def _backward(ctx, grad):
    # dA = alpha·(G + Gᵀ)·A, dC = beta·G: the gradient for the symmetric C (proofs/syrk.md)
    (A,) = ctx.saved_tensors
    grad_a = torch.matmul(grad + grad.mT, A) * ctx.alpha
    grad_c = grad * ctx.beta if ctx.has_c else None
    return grad_a, grad_c, None, None, None


syrk.register_autograd(_backward, setup_context=_setup_context)
register_batched_vmap(syrk, 2, 0)


def _samples():
    g = torch.Generator().manual_seed(0)

    def r(*shape, dtype=torch.float32, grad=False):
        return torch.randn(*shape, generator=g, dtype=dtype).requires_grad_(grad)

    def sym(n, lead=(), dtype=torch.float32):
        s = r(*lead, n, n, dtype=dtype)
        return s + s.mT

    yield (r(8, 16),), {}
    yield (r(8, 16, grad=True),), {"alpha": 0.5}
    yield (r(8, 16, grad=True), sym(8).requires_grad_()), {"alpha": 2.0, "beta": -0.5}
    yield (r(3, 600, 40),), {"alpha": 1.5}  # batched, blocked strips on CPU
    yield (r(2, 5, 7, dtype=torch.bfloat16), sym(5, (2,), torch.bfloat16)), {"beta": 1.0}
    yield (r(6, 4),), {"impl": "torch_mm"}


register_op(OpSpec("dmuon::syrk", torch.ops.dmuon.syrk, _samples, True))
