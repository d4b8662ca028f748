"""The gradient guard of both faces (proofs/guard.md): one on-device decision from the job's
Σ‖g‖² (clip coefficient, finite flag), equal on every rank; the masked write of a skipped step."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

NONFINITE = ("skip", "raise", "ignore")


def squared_norms(grads: Sequence[Tensor], device: torch.device) -> Tensor:
    """‖g‖² per gradient, shape (len(grads),), float64 on `device`: each norm in the gradient's
    dtype (as clip_grad_norm_), squared in float64 so a sum of finite norms never overflows."""
    if not grads:
        return torch.zeros(0, dtype=torch.float64, device=device)
    norms = torch._foreach_norm(list(grads))
    return torch.stack([n.to(device, torch.float64) for n in norms]).square()


def counters(device: torch.device) -> tuple[Tensor, Tensor]:
    """The guard's zeroed 0-d counters on `device`: (skipped steps int64, last norm float32)."""
    return tuple(torch.zeros((), dtype=dt, device=device) for dt in (torch.int64, torch.float32))


def clip_coefficient(total_norm: Tensor, max_norm: float) -> Tensor:
    """min(1, max_norm / (‖g‖ + 1e-6)), as torch.nn.utils.clip_grad_norm_ (float32)."""
    return (max_norm / (total_norm.float() + 1e-6)).clamp(max=1.0)


def check_max_norm(max_norm: float | None) -> None:
    if max_norm is not None and not max_norm > 0.0:
        raise ValueError(f"max_grad_norm must be > 0 (or None for no clipping), got {max_norm!r}")


class Verdict(NamedTuple):
    """A step's guard decision, the same on every rank (read from all-reduced sums)."""

    norm: Tensor  # ‖all gradients‖ before clipping: float64, 0-d
    ok: Tensor | None  # bool, 0-d: every gradient finite; masks every write (None: unmasked)
    coef: Tensor | None  # the clip coefficient: float32, 0-d (None: no clipping)


def judge(once: Tensor, every: Tensor, nonfinite: str, max_norm: float | None) -> Verdict:
    """The decision from the job's unclipped Σ‖g‖² counting each value once (`once`) and over
    every local copy (`every`), both float64 0-d."""
    norm = once.sqrt()
    ok = None if nonfinite == "ignore" else torch.isfinite(every)
    return Verdict(norm, ok, None if max_norm is None else clip_coefficient(norm, max_norm))


def tally(skipped: Tensor, ok: Tensor | None) -> Tensor:
    """The skipped-steps counter (int64, 0-d) after a step whose finite flag is `ok`."""
    return skipped if ok is None else skipped + (~ok).to(skipped.dtype)


def keep(ok: Tensor | None, new: Tensor, old: Tensor) -> Tensor:
    """`new`, or `old` where the step is skipped (`ok` False): a masked write, no host sync."""
    return new if ok is None else torch.where(ok.to(old.device), new, old)


def write(dst: Tensor, new: Tensor, ok: Tensor | None) -> None:
    dst.copy_(keep(ok, new, dst))
