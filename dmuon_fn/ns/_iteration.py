"""The Newton-Schulz iterations (steps 2-4 and both iterations of the algorithm in
_orthogonalize.py's docstring): X is (..., n, m) with n <= m, already normalized, in the
iteration dtype; `impl` names the SYRK kernel (custom_ops.KERNELS)."""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch
from torch import Tensor


def plain_eager() -> bool:
    """Whether buffers may be reused through out= and in-place writes: not while torch.compile
    traces (the compiler plans memory) nor under a torch.func transform (out= has no batching
    rule, and a buffer made inside vmap is not batched like the inputs)."""
    return not (torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active())


def normalize(
    G: Tensor, eps: float, out_dtype: torch.dtype | None = None, scratch: Tensor | None = None
) -> Tensor:
    """G / max|G|, then / (‖·‖_F + eps), per matrix, in fp32 (fp64 stays fp64), returned in
    `out_dtype` (default: that fp32/fp64). The scaled copy is written into `scratch` (a
    contiguous tensor of G's shape in fp32/fp64; G itself is allowed) or a new tensor, the second
    division in place (why: proofs/ns_notes.md)."""
    dt = torch.promote_types(G.dtype, torch.float32)
    dims = (-2, -1)
    if G.dim() == 2:  # one aminmax pass over G (over dims it is the slow path)
        lo, hi = torch.aminmax(G)
        amax = torch.maximum(-lo, hi).reshape(1, 1)
    else:
        amax = torch.maximum(
            -torch.amin(G, dim=dims, keepdim=True), torch.amax(G, dim=dims, keepdim=True)
        )
    X = torch.div(G, amax.to(dt).clamp_min(torch.finfo(dt).tiny), out=scratch)
    X.div_(torch.linalg.vector_norm(X, dim=dims, keepdim=True) + eps)
    if out_dtype is None or out_dtype == dt:
        return X
    return X.to(out_dtype, memory_format=torch.contiguous_format)


def standard(X: Tensor, rows: Sequence[tuple[float, float, float]], impl: str) -> Tensor:
    for a, b, c in rows:
        X = torch.ops.dmuon.ns_step(X, a, b, c, impl=impl)
    return X


def gram(
    X: Tensor,
    rows: Sequence[tuple[float, float, float]],
    restarts: Collection[int],
    impl: str,
    scratch: Sequence[Tensor] = (),
) -> Tensor:
    """Gram NS from the normalized X, which is consumed. In plain eager mode each restart writes
    the new iterate into an already-touched buffer instead of a fresh, page-faulting one: one of
    `scratch` (tensors of X's shape and dtype that may hold intermediate iterates, never the
    result) or a dead earlier iterate."""
    # Q = q·I + Qz; Qz None means Q = q·I (see dmuon::gram_ns_step for why the split).
    R = torch.ops.dmuon.syrk(X, impl=impl)
    Qz, q = None, 1.0
    free, dead = list(scratch), []  # buffers for intermediate iterates / for any iterate
    for i, (a, b, c) in enumerate(rows):
        if i in restarts:
            dst = free.pop() if free else dead.pop() if dead else None
            X, old = apply_q(Qz, q, X, dst), X
            in_scratch = any(old.data_ptr() == t.data_ptr() for t in scratch)
            (free if in_scratch else dead).append(old)
            R = torch.ops.dmuon.syrk(X, impl=impl)
            Qz, q = None, 1.0
        last = i == len(rows) - 1 or (i + 1) in restarts
        Qz, R = torch.ops.dmuon.gram_ns_step(R, Qz, a, b, c, q, update_r=not last, impl=impl)
        q *= a
    return apply_q(Qz, q, X, dead.pop() if dead else None)


def halves(buf: Tensor | None, X: Tensor) -> tuple[Tensor, ...]:
    """Two tensors of X's shape and dtype in buf's storage, when buf (which holds nothing live
    while the iterates run) is at least twice X's size: bf16 iterates in an fp32 buffer."""
    if buf is None or 2 * X.element_size() > buf.element_size():
        return ()
    flat = buf.view(-1).view(X.dtype)
    return flat[: X.numel()].view(X.shape), flat[X.numel() : 2 * X.numel()].view(X.shape)


def apply_q(Qz: Tensor | None, q: float, X: Tensor, out: Tensor | None = None) -> Tensor:
    """(q·I + Qz)·X with the identity part added in the GEMM's fp32 accumulation; written into
    and returned as `out` (X's shape and dtype, not X) when given in plain eager mode."""
    if not plain_eager():
        out = None
    if Qz is None:
        return torch.mul(X, q, out=out)
    flat = X.reshape(-1, *X.shape[-2:])
    Qz3 = Qz.reshape(-1, *Qz.shape[-2:])
    if out is None:
        return torch.baddbmm(flat, Qz3, flat, beta=q).reshape(X.shape)
    torch.baddbmm(flat, Qz3, flat, beta=q, out=out.view(flat.shape))
    return out
