"""dmuon::ns_step — one standard quintic Newton-Schulz step on SYRK.

X: (..., n, m) with n <= m (the caller transposes tall matrices). Returns X' in X's shape and dtype:
    A  = X·Xᵀ                     (syrk)
    B  = b·A + c·A²               (syrk of the symmetric A, with C = A)
    X' = a·X + B·X                (one full GEMM)
No autograd: the step computes an optimizer update under no_grad."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import Tensor

from ._kernels import SymMM, resolve_kernel
from ._registry import OpSpec, register_batched_vmap, register_op


def _check(X: Tensor) -> None:
    if X.dim() < 2 or X.shape[-2] > X.shape[-1]:
        raise ValueError(f"ns_step: X must be (..., n, m) with n <= m, got {tuple(X.shape)}")


def ns_step_math(X: Tensor, a: float, b: float, c: float, impl: str = "auto") -> Tensor:
    return step_for(X, impl)(X, a, b, c)


def step_for(X: Tensor, impl: str = "auto") -> Callable[[Tensor, float, float, float], Tensor]:
    """(X, a, b, c) -> ns_step_math(X, a, b, c, impl) for iterates shaped like X, checked and
    its kernel resolved once: an eager loop's steps (dmuon_fn.ns._iteration.standard)."""
    _check(X)
    return functools.partial(_quintic, resolve_kernel(impl, X.device).sym_mm)


def _quintic(sym_mm: SymMM, X: Tensor, a: float, b: float, c: float) -> Tensor:
    A = sym_mm(X, X.mT, None, 1.0, 0.0)
    B = sym_mm(A, A, A, c, b)
    if X.dim() == 2:  # addmm: the 2-D GEMM path, faster than a batch of one on a CPU
        return torch.addmm(X, B, X, beta=a)
    X3 = X.reshape(-1, *X.shape[-2:])
    return torch.baddbmm(X3, B.reshape(-1, *B.shape[-2:]), X3, beta=a).reshape(X.shape)


# the op; ns_step_math is its body, which eager callers may run directly (dmuon_fn.ns._iteration)
ns_step = torch.library.custom_op("dmuon::ns_step", ns_step_math, mutates_args=())


@ns_step.register_fake
def _(X, a, b, c, impl="auto"):
    _check(X)
    return torch.empty_like(X)


register_batched_vmap(ns_step, 1, 0)


def _samples():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 24, generator=g)
    yield (x / x.norm(), 3.4445, -4.7750, 2.0315), {}
    x = torch.randn(2, 3, 16, 16, generator=g)
    yield (x / x.norm(dim=(-2, -1), keepdim=True), 2.0, -1.5, 0.5), {}
    x = torch.randn(520, 530, generator=g)  # big enough for the blocked CPU strips
    yield ((x / x.norm()).bfloat16(), 3.4445, -4.7750, 2.0315), {}


register_op(OpSpec("dmuon::ns_step", torch.ops.dmuon.ns_step, _samples, False))
