"""dmuon::gram_ns_step — one Newton-Schulz step carried out in Gram space.

With X_k = Q_k·X_0 and R_k = X_k·X_kᵀ, every product below is of commuting symmetric matrices
(SYRK); P = a·I + Z, Q = q·I + Q_z keep their identity parts exact (proofs/custom_ops_notes.md).
    Z    = b·R + c·R²                       (syrk of R with C = R)
    Q_z' = Z·Q_z + a·Q_z + q·Z              (q·Z when Q_z is None, i.e. Q = q·I)
    R'   = Z·T + a·T,  T = Z·R + a·R        (P·R·P; only when `update_r`)
so that Q' = (a·q)·I + Q_z'. R: (..., n, n); Q_z: (..., n, n) or None. Returns (Q_z', R'), R' a
(..., 0, 0) placeholder when not `update_r`. No autograd: an optimizer update, as ns_step."""

from __future__ import annotations

import torch
from torch import Tensor

from ._kernels import resolve_kernel
from ._registry import OpSpec, check_like, register_batched_vmap, register_op


def _check(R: Tensor, Qz: Tensor | None) -> None:
    if R.dim() < 2 or R.shape[-2] != R.shape[-1]:
        raise ValueError(f"gram_ns_step: R must be (..., n, n), got {tuple(R.shape)}")
    check_like("gram_ns_step", "Qz", Qz, R.shape, R.dtype)


def gram_ns_step_math(
    R: Tensor,
    Qz: Tensor | None,
    a: float,
    b: float,
    c: float,
    q: float = 1.0,
    update_r: bool = True,
    impl: str = "auto",
) -> tuple[Tensor, Tensor]:
    _check(R, Qz)
    sym_mm = resolve_kernel(impl, R.device).sym_mm
    Z = sym_mm(R, R, R, c, b)
    if Qz is None:
        Qz_next = Z * q if q != 1.0 else Z
    else:  # a·Qz rides in the GEMM's fp32 accumulation; q·Z is added after, in place
        Qz_next = sym_mm(Z, Qz, Qz, 1.0, a).add_(Z, alpha=q)
    if update_r:
        T = sym_mm(Z, R, R, 1.0, a)
        R_next = sym_mm(Z, T, T, 1.0, a)
    else:
        R_next = R.new_empty((*R.shape[:-2], 0, 0))
    return Qz_next, R_next


# the op; its body gram_ns_step_math is what eager callers run directly (dmuon_fn.ns._iteration)
gram_ns_step = torch.library.custom_op("dmuon::gram_ns_step", gram_ns_step_math, mutates_args=())


@gram_ns_step.register_fake
def _(R, Qz, a, b, c, q=1.0, update_r=True, impl="auto"):
    _check(R, Qz)
    r_shape = R.shape if update_r else (*R.shape[:-2], 0, 0)
    return R.new_empty(R.shape), R.new_empty(r_shape)


register_batched_vmap(gram_ns_step, 2, (0, 0))


def _samples():
    g = torch.Generator().manual_seed(2)

    def gram(*shape, dtype=torch.float32):
        x = torch.randn(*shape, generator=g)
        x = x / x.norm(dim=(-2, -1), keepdim=True)
        return (x @ x.mT).to(dtype)

    R = gram(8, 20)
    yield (R, None, 3.4445, -4.7750, 2.0315), {}
    yield (R, gram(8, 9) * 1.5, 3.4445, -4.7750, 2.0315), {"q": 2.5, "update_r": False}
    yield (gram(3, 12, 30), None, 2.0, -1.5, 0.5), {"q": 0.5}
    yield (gram(600, 700, dtype=torch.bfloat16), None, 3.4445, -4.7750, 2.0315), {}


register_op(OpSpec("dmuon::gram_ns_step", torch.ops.dmuon.gram_ns_step, _samples, False))
