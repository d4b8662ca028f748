"""What the planner reads from a tensor-parallel layout: how `Shard(d)` splits a dim (torch.chunk's
sizes), and which layouts leave every tensor rank whole matrices of a parameter (expert
parallelism: each tensor rank orthogonalizes its own, tensor slot `LOCAL`);
proofs/tensor_parallel.md claims 1 and 11."""

from __future__ import annotations

import re

from ..ns._blocks import Blocks

LOCAL = -1  # the tensor slot of a parameter every tensor rank orthogonalizes its part of
_SHARD = re.compile(r"Shard\(([0-9]+)\)")


def chunk_sizes(n: int, parts: int) -> tuple[int, ...]:
    """Each of `parts` ranks' extent of a dim of size n under Shard: torch.chunk's
    (proofs/tensor_parallel.md claim 1)."""
    step = -(-n // parts)
    return tuple(max(0, min(step, n - t * step)) for t in range(parts))


def shard_dim(layout: str) -> int | None:
    """d of a "Shard(d)" layout; None for "Replicate()" and "plain"."""
    m = _SHARD.fullmatch(layout)
    return None if m is None else int(m.group(1))


def keeps_matrices(layout: str, spec: Blocks | None) -> bool:
    """Whether `layout` splits a parameter read as `spec` along one of its batch dims, so each
    tensor rank's part is whole matrices of it (MoE experts, `Shard(0)`: expert parallelism)."""
    d = shard_dim(layout)
    return spec is not None and d is not None and d < spec.batch


def tensor_shares(
    shape: tuple[int, ...], layout: str, tensor_slot: int, tensor_size: int
) -> tuple[float, ...]:
    """The fraction of a parameter's Newton-Schulz each tensor rank of its owner slot runs: all
    of it on `tensor_slot`, or (LOCAL) each rank's share of the experts it holds."""
    if tensor_slot != LOCAL:
        return tuple(float(t == tensor_slot) for t in range(tensor_size))
    n = shape[shard_dim(layout)]
    return tuple(c / n for c in chunk_sizes(n, tensor_size))
