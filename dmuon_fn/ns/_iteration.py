"""The Newton-Schulz iterations (steps 2-4 and both iterations of _orthogonalize.py's algorithm) and
their coefficient rows, each (a, b, c) one quintic step X ← a·X + b·(XXᵀ)X + c·(XXᵀ)²X. X is
(..., n, m), n <= m, normalized, in the iteration dtype; `impl`: a kernel of custom_ops.KERNELS."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Collection, Sequence
from pathlib import Path

import torch
from torch import Tensor
from torch.utils._python_dispatch import _get_current_dispatch_mode

from custom_ops.gram_ns_step import gram_ns_step_math
from custom_ops.ns_step import ns_step_math, step_for
from custom_ops.syrk import syrk_math

Row = tuple[float, float, float]

_TABLES = json.loads(Path(__file__).with_name("coefficients.json").read_text(encoding="utf-8"))
KELLER: tuple[Row, ...] = tuple(map(tuple, _TABLES["keller"]["rows"]))
_POLAR_EXPRESS_RAW: tuple[Row, ...] = tuple(map(tuple, _TABLES["polar_express"]["rows"]))
POLAR_EXPRESS_SAFETY = _TABLES["polar_express"]["safety"]
POLAR_EXPRESS: tuple[Row, ...] = tuple(
    (a / POLAR_EXPRESS_SAFETY, b / POLAR_EXPRESS_SAFETY**3, c / POLAR_EXPRESS_SAFETY**5)
    for a, b, c in _POLAR_EXPRESS_RAW
)
YOU: tuple[Row, ...] = tuple(map(tuple, _TABLES["you"]["rows"]))

PRESETS: dict[str, tuple[Row, ...]] = {"keller": KELLER, "polar_express": POLAR_EXPRESS, "you": YOU}


def schedule(coefficients: str | Sequence[Sequence[float]], steps: int) -> tuple[Row, ...]:
    """Exactly `steps` rows: a preset name or explicit rows, truncated or last-row-repeated."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive int, got {steps!r}")
    if isinstance(coefficients, str):
        if coefficients not in PRESETS:
            raise ValueError(
                f"unknown coefficients preset {coefficients!r}; "
                f"choose one of {sorted(PRESETS)} or pass a list of (a, b, c) rows"
            )
        rows = PRESETS[coefficients]
    else:
        rows = tuple(tuple(float(v) for v in row) for row in coefficients)
        if not rows or any(len(row) != 3 for row in rows):
            raise ValueError(
                f"coefficients must be a non-empty list of (a, b, c) rows, got {coefficients!r}"
            )
    return tuple(rows[min(i, len(rows) - 1)] for i in range(steps))  # type: ignore[misc]


def plain_eager() -> bool:
    """Whether buffers may be reused through out= and in-place writes (proofs/ns_notes.md)."""
    return not (torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active())


def normalize(
    G: Tensor, eps: float, out_dtype: torch.dtype | None = None, scratch: Tensor | None = None
) -> Tensor:
    """G / max|G| / (‖·‖_F + eps) per matrix in fp32 (fp64 stays fp64), returned in `out_dtype`
    (default: that dtype); written into `scratch` (contiguous, G's shape, fp32/fp64; may be G)."""
    dt = torch.promote_types(G.dtype, torch.float32)
    dims = (-2, -1)
    scale = max_abs(G).to(dt).clamp_min(torch.finfo(dt).tiny)
    if scratch is not None and not G.is_contiguous():
        # the same quotients, elementwise: a blocked transposing copy, then a contiguous
        # divide, ~2x faster than one divide through a transposed view (proofs/ns_notes.md)
        X = transpose_into(scratch, G).div_(scale)
    else:
        X = torch.div(G, scale, out=scratch)
    X.div_(torch.linalg.vector_norm(X, dim=dims, keepdim=True) + eps)
    if out_dtype is None or out_dtype == dt:
        return X
    return X.to(out_dtype, memory_format=torch.contiguous_format)


def max_abs(G: Tensor) -> Tensor:
    """max|G| per matrix, (..., 1, 1) in G's dtype: for one matrix one aminmax pass (over dims
    it is the slow path); a transposed view (a tall matrix) is read in memory order, since min
    and max are exact in any order and aminmax does not reorder a strided view (~10x slower)."""
    if G.dim() == 2:
        lo, hi = torch.aminmax(G.mT if G.mT.is_contiguous() and not G.is_contiguous() else G)
        return torch.maximum(-lo, hi).reshape(1, 1)
    lo, hi = torch.amin(G, dim=(-2, -1), keepdim=True), torch.amax(G, dim=(-2, -1), keepdim=True)
    return torch.maximum(-lo, hi)


# a transposing copy of at least TRANSPOSE_BLOCKED_FROM elements goes by TRANSPOSE_BLOCK source rows
TRANSPOSE_BLOCKED_FROM, TRANSPOSE_BLOCK = 1 << 20, 64


def transpose_into(dst: Tensor, src: Tensor) -> Tensor:
    """`dst.copy_(src)`, `src` the transposed view of a contiguous tensor and `dst` contiguous:
    large copies by blocks of TRANSPOSE_BLOCK of the source's rows, each read in memory order
    (the same bits; 4096×1024 fp32 on 2 cores: 2.9 ms against 10.3 in one copy)."""
    if src.numel() < TRANSPOSE_BLOCKED_FROM:
        return dst.copy_(src)
    for i in range(0, src.shape[-1], TRANSPOSE_BLOCK):
        dst[..., i : i + TRANSPOSE_BLOCK].copy_(src[..., i : i + TRANSPOSE_BLOCK])
    return dst


def ops(X: Tensor) -> tuple:
    """(ns_step, gram_ns_step, syrk) for an iteration from X: the dmuon:: custom ops where
    anything traces or intercepts them (torch.compile, functorch transforms, a dispatch mode, a
    tensor subclass, autograd), else their bodies called directly: the same arithmetic without
    the op dispatch's ~70-100 µs per call, which at small sizes costs as much as the GEMMs."""
    direct = (
        plain_eager()
        and _get_current_dispatch_mode() is None
        and type(X) is Tensor
        and not X.requires_grad
    )
    if direct:
        return ns_step_math, gram_ns_step_math, syrk_math
    return torch.ops.dmuon.ns_step, torch.ops.dmuon.gram_ns_step, torch.ops.dmuon.syrk


def standard(
    X: Tensor,
    rows: Sequence[Row],
    impl: str,
    gram_of: Callable[[Tensor], Tensor] | None = None,
    poly_of: Callable[[Tensor, float, float], Tensor] | None = None,
) -> Tensor:
    """Standard NS from the normalized X. For a team's slice of a matrix (proofs/team_ns.md),
    gram_of gives the whole matrix's X·Xᵀ and poly_of(A, b, c) b·A + c·A² of it (both or
    neither); each step is then (a·I + b·A + c·A²)·X."""
    ns_step = ops(X)[0]
    if gram_of is not None:
        step = lambda X, a, b, c: apply_q(poly_of(gram_of(X), b, c), a, X)  # noqa: E731
    elif ns_step is ns_step_math:  # the body: X checked and its kernel resolved once
        step = step_for(X, impl)
    else:
        step = functools.partial(ns_step, impl=impl)
    for a, b, c in rows:
        X = step(X, a, b, c)
    return X


def gram(
    X: Tensor,
    rows: Sequence[Row],
    restarts: Collection[int],
    impl: str,
    scratch: Sequence[Tensor] = (),
    gram_of: Callable[[Tensor], Tensor] | None = None,
) -> Tensor:
    """Gram NS from the normalized X, which is consumed. Eager restarts write into `scratch`
    (X's shape and dtype; never the result) or a dead iterate (proofs/buffers.md). gram_of: as
    `standard`'s, for the (re)starts' X·Xᵀ."""
    # Q = q·I + Qz; Qz None means Q = q·I (see dmuon::gram_ns_step for why the split).
    _, gram_ns_step, syrk = ops(X)
    if gram_of is None:
        gram_of = functools.partial(syrk, impl=impl)
    R = gram_of(X)
    Qz, q = None, 1.0
    free, dead = list(scratch), []  # buffers for intermediate iterates / for any iterate
    for i, (a, b, c) in enumerate(rows):
        if i in restarts:
            dst = free.pop() if free else dead.pop() if dead else None
            X, old = apply_q(Qz, q, X, dst), X
            in_scratch = any(old.data_ptr() == t.data_ptr() for t in scratch)
            (free if in_scratch else dead).append(old)
            R = gram_of(X)
            Qz, q = None, 1.0
        last = i == len(rows) - 1 or (i + 1) in restarts
        Qz, R = gram_ns_step(R, Qz, a, b, c, q, update_r=not last, impl=impl)
        q *= a
    return apply_q(Qz, q, X, dead.pop() if dead else None)


def halves(buf: Tensor | None, X: Tensor) -> tuple[Tensor, ...]:
    """Two tensors of X's shape and dtype in the storage of buf (nothing live in it), when it is
    at least twice X's size (bf16 iterates in an fp32 buffer); else ()."""
    if buf is None or 2 * X.element_size() > buf.element_size():
        return ()
    flat = buf.view(-1).view(X.dtype)
    return flat[: X.numel()].view(X.shape), flat[X.numel() : 2 * X.numel()].view(X.shape)


def apply_q(Qz: Tensor | None, q: float, X: Tensor, out: Tensor | None = None) -> Tensor:
    """(q·I + Qz)·X, the identity added in the GEMM's accumulation; in eager written into `out`
    (X's shape and dtype, not X) if given."""
    if not plain_eager():
        out = None
    if Qz is None:
        return torch.mul(X, q, out=out)
    if X.dim() == 2:  # addmm: the 2-D GEMM path, faster than a batch of one on a CPU
        return torch.addmm(X, Qz, X, beta=q, out=out)
    flat = X.reshape(-1, *X.shape[-2:])
    Qz3 = Qz.reshape(-1, *Qz.shape[-2:])
    if out is None:
        return torch.baddbmm(flat, Qz3, flat, beta=q).reshape(X.shape)
    torch.baddbmm(flat, Qz3, flat, beta=q, out=out.view(flat.shape))
    return out
