"""The gradient guard both faces share: the global gradient norm (clipping, non-finite
detection) as one decision every rank takes alike, on device, and the masked write that makes a
skipped step change nothing (proofs/guard.md)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from ..comm._errors import phase

NONFINITE = ("skip", "raise", "ignore")


def squared_norms(grads: Sequence[Tensor], device: torch.device) -> Tensor:
    """‖g‖² per gradient, float64, on `device` (shape (len(grads),)).

    Per-tensor norms in the gradient's own dtype (as torch.nn.utils.clip_grad_norm_), squared
    in float64 so that a sum of finite norms never overflows.
    """
    if not grads:
        return torch.zeros(0, dtype=torch.float64, device=device)
    norms = torch._foreach_norm(list(grads))
    return torch.stack([n.to(device, torch.float64) for n in norms]).square()


def total(sq: Sequence[Tensor], device: torch.device) -> Tensor:
    """The sum of 0-d float64 tensors (0 for none), on device: no host-built index or mask,
    which would be a blocking host-to-device copy on CUDA."""
    if not sq:
        return torch.zeros((), dtype=torch.float64, device=device)
    return torch.stack(list(sq)).sum()


def all_reduce_sum(t: Tensor, what: str) -> Tensor:
    """In place over the world (no-op without torch.distributed or on a world of one)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        with phase(what):
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def counters(device: torch.device) -> tuple[Tensor, Tensor]:
    """The guard's 0-d counters, zeroed: (steps skipped for a non-finite gradient, int64; the
    last global gradient norm, float32). Device tensors: reading them syncs."""
    return (
        torch.zeros((), dtype=torch.int64, device=device),
        torch.zeros((), dtype=torch.float32, device=device),
    )


def clip_coefficient(total_norm: Tensor, max_norm: float) -> Tensor:
    """min(1, max_norm / (‖g‖ + 1e-6)), as torch.nn.utils.clip_grad_norm_ (float32)."""
    return (max_norm / (total_norm.float() + 1e-6)).clamp(max=1.0)


def check_max_norm(max_norm: float | None) -> None:
    if max_norm is not None and not max_norm > 0.0:
        raise ValueError(f"max_grad_norm must be > 0 (or None for no clipping), got {max_norm!r}")


class Verdict(NamedTuple):
    """A step's guard decision, the same on every rank (it is read from all-reduced sums)."""

    norm: Tensor  # ‖all gradients‖ before clipping: float64, 0-d
    ok: Tensor | None  # bool, 0-d: every gradient finite; masks every write (None: unmasked)
    coef: Tensor | None  # the clip coefficient: float32, 0-d (None: no clipping)


def judge(once: Tensor, every: Tensor, nonfinite: str, max_norm: float | None) -> Verdict:
    """The decision from the job's Σ‖g‖² counting each value once (`once`) and over every local
    copy (`every`), both float64 0-d, taken before any clipping."""
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
    """dst ← `keep(ok, new, dst)` in place: the object API's masked write."""
    dst.copy_(keep(ok, new, dst))
