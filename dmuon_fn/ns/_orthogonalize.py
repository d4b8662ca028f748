"""Orthogonalization by Newton-Schulz: O ≈ U·Vᵀ for G = U·Σ·Vᵀ. The algorithm, once (proofs:
gram_ns.md, ns_symmetry.md, normalization.md):
    1. if rows > cols: X ← Gᵀ             iterate on the short side
    2. X ← X / max|X|                     in fp32 (fp64 stays fp64): no overflow, exact zeros kept
    3. X ← X / (‖X‖_F + eps)              spectral norm ≤ 1, so every σ lies in [0, 1]
    4. X ← X.to(iteration dtype)          only now leave fp32
    standard:  for (a, b, c) in schedule: X ← a·X + (b·A + c·A²)·X,  A = X·Xᵀ   (dmuon::ns_step)
    gram:      R ← X·Xᵀ; Q ← I
               for step i, (a, b, c) in schedule:
                   if i is a restart: X ← Q·X; R ← X·Xᵀ; Q ← I
                   P ← a·I + b·R + c·R²;  Q ← P·Q;  R ← P·R·P   (dmuon::gram_ns_step)
               X ← Q·X      (Q, P carried as scalar·I + matrix; restarts: `default_restarts`)
    5. undo the transpose, cast back to G's dtype

`get_ns_backend` names, in one line, what runs on a device.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

import custom_ops

from ._cost import GRAM_MIN_SHORT, default_restarts, ns_method
from ._dispatch import (
    dtype_reason,
    gram_min_aspect,
    gram_min_short,
    iteration_dtype,
    kernel_choice,
)
from ._iteration import gram, halves, normalize, plain_eager, schedule, standard

_ITER_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


@dataclass(frozen=True)
class NSConfig:
    """Keyword configuration of `orthogonalize`, shared by the update functions and `Muon`."""

    steps: int = 5  # quintic steps, always honoured
    coefficients: str | tuple[tuple[float, float, float], ...] = "polar_express"  # preset or rows
    method: str = "auto"  # | "gram" | "standard"; auto: Gram from the device's long/short ratio
    eps: float = 1e-7  # added to the Frobenius norm before dividing
    restarts: tuple[int, ...] | None = None  # Gram restart steps; None: default_restarts(steps)
    kernel: str | None = None  # SYRK kernel; None: $DMUON_NS_KERNEL, else the device's choice
    dtype: torch.dtype | None = None  # iteration dtype; None: the device's (float64 in: float64)

    def __post_init__(self) -> None:
        if not isinstance(self.coefficients, str):
            rows = tuple(tuple(float(v) for v in row) for row in self.coefficients)
            object.__setattr__(self, "coefficients", rows)
        if self.restarts is not None:
            object.__setattr__(self, "restarts", tuple(sorted(set(self.restarts))))
        schedule(self.coefficients, self.steps)  # validates steps and coefficients
        ns_method((1, 1), self.method)  # validates method
        if not (self.eps >= 0.0):
            raise ValueError(f"eps must be >= 0, got {self.eps!r}")
        if self.dtype is not None and self.dtype not in _ITER_DTYPES:
            raise ValueError(f"dtype must be one of {_ITER_DTYPES}, got {self.dtype!r}")
        for r in self.restarts or ():
            if isinstance(r, bool) or not isinstance(r, int) or not 0 < r < self.steps:
                raise ValueError(
                    f"restarts must be ints in [1, steps-1] = [1, {self.steps - 1}], "
                    f"got {self.restarts!r}"
                )


def orthogonalize(
    G: Tensor,
    *,
    steps: int = 5,
    coefficients: str | Sequence[Sequence[float]] = "polar_express",
    method: str = "auto",
    eps: float = 1e-7,
    restarts: Collection[int] | None = None,
    kernel: str | None = None,
    dtype: torch.dtype | None = None,
) -> Tensor:
    """The polar factor U·Vᵀ of each matrix of G (..., m, n), any floating dtype, approximated
    by `steps` Newton-Schulz steps; G's shape and dtype (options: `NSConfig`)."""
    cfg = NSConfig(steps, coefficients, method, eps, restarts, kernel, dtype)  # validates them
    return orthogonalize_with(G, cfg)


def orthogonalize_with(G: Tensor, cfg: NSConfig, *, overwrite: bool = False) -> Tensor:
    """`orthogonalize` with a validated `NSConfig`. overwrite: the caller no longer reads G, so
    a wide, contiguous fp32/fp64 G's buffer may hold the normalized copy and the result."""
    if G.dim() < 2 or not G.is_floating_point():
        raise ValueError(
            f"orthogonalize needs a floating matrix or batch of matrices (..., m, n), "
            f"got {G.dtype} of shape {tuple(G.shape)}; reshape conv weights to 2-D first"
        )
    if G.requires_grad and torch.is_grad_enabled():
        raise ValueError(
            "orthogonalize computes an optimizer update and is not differentiable: pass "
            "G.detach(), or call it under torch.no_grad()"
        )
    if G.numel() == 0:
        return torch.zeros_like(G)  # an empty batch or a 0-width matrix: nothing to orthogonalize
    tall = G.shape[-2] > G.shape[-1]
    src = G.mT if tall else G  # iterate on the short side
    dt = torch.promote_types(G.dtype, torch.float32)
    it, impl, method = iteration(cfg, G, src.shape[-2:])
    # Eager: one buffer holds the normalized copy and, under narrower iterates, the result.
    buf = None
    if plain_eager():
        reuse = overwrite and not tall and G.dtype == dt and G.is_contiguous()
        buf = G if reuse else torch.empty(src.shape, dtype=dt, device=G.device)
    X = normalize(src if buf is not None else src.contiguous(), cfg.eps, it, scratch=buf)
    rows = schedule(cfg.coefficients, cfg.steps)
    if method == "gram":
        X = gram(X, rows, restarts_of(cfg), impl, halves(buf, X))
    else:
        X = standard(X, rows, impl)
    if buf is not None and G.dtype == dt and X.dtype != dt:
        X = buf.copy_(X)
    return (X.mT if tall else X).to(G.dtype)


def iteration(cfg: NSConfig, G: Tensor, shape: Sequence[int]) -> tuple[torch.dtype, str, str]:
    """(iteration dtype, SYRK kernel, "gram" or "standard") for G under `cfg`, the form chosen
    for a (short, long) `shape`; raises where low-precision Gram NS is unsafe. Resolves the
    device's dispatch (on a CPU: also the SYRK strip table) whatever cfg says."""
    short = int(shape[0])
    impl = kernel_choice(cfg.kernel, G.device, short if G.device.type == "cuda" else None)
    aspect, least = gram_min_aspect(G.device), gram_min_short(G.device)
    it = cfg.dtype or (torch.float64 if G.dtype == torch.float64 else iteration_dtype(G.device))
    method = ns_method(tuple(shape), cfg.method, aspect, least)
    if method == "gram" and short < GRAM_MIN_SHORT and it.itemsize < 4:
        raise ValueError(
            f"method='gram' in {it} needs a short side of at least {GRAM_MIN_SHORT} "
            f"(got {tuple(G.shape)}): below it the low-precision Gram iteration can diverge. "
            "Use method='auto' (standard NS there) or dtype=torch.float32"
        )
    return it, impl, method


def restarts_of(cfg: NSConfig) -> frozenset[int]:
    return frozenset(default_restarts(cfg.steps) if cfg.restarts is None else cfg.restarts)


def _default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def get_ns_backend(
    device: torch.device | str | None = None,
    *,
    kernel: str | None = None,
    method: str = "auto",
    dtype: torch.dtype | None = None,
) -> str:
    """One line naming the NS method, SYRK kernel and iteration dtype `orthogonalize` would run on
    `device` (default: the current CUDA device, else the CPU), and why; raises as it would."""
    device = _default_device() if device is None else torch.device(device)
    resolved = custom_ops.KERNELS[kernel_choice(kernel, device)]  # CUDA: measures auto's rule
    ns_method((1, 1), method)  # validates
    aspect = gram_min_aspect(device)  # resolves the dispatch, the CPU's strip table included
    if method != "auto":
        how = ("Gram NS" if method == "gram" else "Standard NS") + " (method=)"
    elif math.isinf(aspect):
        how = "Standard NS (Gram NS measured slower here at every aspect ratio)"
    else:
        least = gram_min_short(device)
        how = f"Gram NS (long/short >= {aspect:g}, short >= {least}; else standard NS)"
    it = dtype or iteration_dtype(device)
    why = "dtype=" if dtype else dtype_reason(device)
    return f"{how} · {custom_ops.describe(resolved, device)} · iterate in {str(it)[6:]} ({why})"
