"""What keeps a long run safe: the global gradient norm (clipping, non-finite detection) and
collective failures that name the phase they happened in.

Global gradient norm, one all-reduce over the world of two sums: the squares of the gradient
entries each rank holds exactly once in the job (a dedicated parameter's reduced gradient on its
global owner; an FSDP2 gradient shard on the replica-0 copy of that shard; a plain parameter's
gradient on a world of one), which is ‖all gradients‖²; and the squares of every local copy
(HSDP replicas included), which is non-finite whenever any rank holds a non-finite entry. Every
rank then takes the same skip decision from the same value, on device, without a host sync.
"""

from __future__ import annotations

from collections.abc import Sequence

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


def check_nonfinite_mode(mode: str) -> None:
    if mode not in NONFINITE:
        raise ValueError(f"nonfinite must be one of {NONFINITE}, got {mode!r}")


def check_max_norm(max_norm: float | None) -> None:
    if max_norm is not None and not max_norm > 0.0:
        raise ValueError(f"max_grad_norm must be > 0 (or None for no clipping), got {max_norm!r}")
