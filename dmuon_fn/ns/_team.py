"""Newton-Schulz shared by a team of ranks (proofs/team_ns.md). Each member holds one slice of a
matrix cut along its long side. Every iterate of the standard and of the Gram form is a
polynomial in the short-side Gram matrix X·Xᵀ = Σ X_i·X_iᵀ applied to X, so with that m×m sum
(one all-reduce per standard step, or per Gram start and restart) each member updates its own
slice; the normalization needs max|X| and ‖X‖_F, from one all-gather of two scalars."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import Tensor

from ._cost import member_shape
from ._iteration import gram, max_abs, ops, schedule, standard
from ._orthogonalize import NSConfig, iteration, restarts_of


class Team(NamedTuple):
    """A team member's part in one matrix's Newton-Schulz: the team's group, the whole matrix's
    shape, and the dim (-2: rows, -1: columns) the matrix is cut along. A gathered team
    (`pieces` given; proofs/partition.md §12): the whole unit's shape (a parameter, a piece of
    a batch or a team member's slice), cut along dim `dim` (0 or 1) into pieces of `pieces`
    indices held by group ranks `order` (in piece order); the first piece's holder
    orthogonalizes the whole (`orthogonalize_gathered`); `inner`: the team the unit is a
    member's slice of (its group None on the other pieces' holders, which only learn the
    matrix's shape, for the update's scale)."""

    group: dist.ProcessGroup | None
    shape: tuple[int, ...]
    dim: int
    pieces: tuple[int, ...] = ()
    order: tuple[int, ...] = ()
    inner: Team | None = None

    @property
    def orthogonalizes(self) -> bool:
        """Whether this member runs Newton-Schulz: every member of a team (its part), the first
        piece's holder of a gathered one (the whole)."""
        return not self.pieces or dist.get_rank(self.group) == self.order[0]


def orthogonalize_team(
    G: Tensor,
    group: dist.ProcessGroup,
    shape: tuple[int, int] | torch.Size,
    *,
    dim: int = -1,
    cfg: NSConfig | None = None,
) -> Tensor:
    """This rank's slice of `orthogonalize(W)`, where W (..., m, n) has trailing `shape` and `G`
    is this rank's slice of it, cut along `dim` (-1: columns, -2: rows; W's long side) over
    `group`'s ranks in group-rank order, any sizes. Every rank of the group calls it with the
    same leading shape, `shape`, `dim` and `cfg` (default NSConfig()), in the same order as its
    other collectives on the group. Traces under torch.compile (functional collectives) without
    a graph break; returns G's shape and dtype."""
    cfg = NSConfig() if cfg is None else cfg
    if dim not in (-1, -2) or G.dim() < 2 or not G.is_floating_point():
        raise ValueError(
            f"orthogonalize_team needs a floating slice (..., m, n) of a matrix cut along dim -1 "
            f"or -2, got {G.dtype} of shape {tuple(G.shape)} and dim={dim!r}"
        )
    other = -1 if dim == -2 else -2
    full = tuple(int(v) for v in shape[-2:])
    if len(full) != 2 or full[other] != G.shape[other] or not 0 < G.shape[dim] <= full[dim]:
        raise ValueError(
            f"orthogonalize_team: a slice {tuple(G.shape)} along dim {dim} is not part of a "
            f"matrix of shape {full} (the other dim equal, a non-empty part of this one)"
        )
    if full[dim] < full[other]:
        raise ValueError(
            f"orthogonalize_team: dim {dim} is the short side of {full}; cut the long side, so "
            "the team's all-reduce is of the short side's Gram matrix"
        )
    if G.requires_grad and torch.is_grad_enabled():
        raise ValueError("orthogonalize_team computes an optimizer update: pass G.detach()")
    src = G.mT if dim == -2 else G  # the slice along the last dim; its rows are W's short side
    dt = torch.promote_types(G.dtype, torch.float32)
    # the form for a member's share of the long side, the same on every member: Gram's m×m
    # products are every member's, standard's shrink with the share (proofs/team_ns.md)
    it, impl, method = iteration(cfg, G, member_shape(full, dist.get_world_size(group)))
    X = _normalize(src.to(dt), cfg.eps, group).to(it, memory_format=torch.contiguous_format)
    syrk = ops(X)[2]

    def gram_of(Y: Tensor) -> Tensor:  # Σ_i Y_i·Y_iᵀ, summed in fp32 (fp64 stays fp64)
        part = syrk(Y, impl=impl).to(torch.promote_types(Y.dtype, torch.float32))
        if part.dtype == Y.dtype:
            return funcol.all_reduce(part, "sum", group)
        return _summed_as(part, Y.dtype, group)

    rows = schedule(cfg.coefficients, cfg.steps)
    if method == "gram":
        X = gram(X, rows, restarts_of(cfg), impl, gram_of=gram_of)
    else:
        poly = functools.partial(_shared_poly, group=group)
        X = standard(X, rows, impl, gram_of=gram_of, poly_of=poly)
    return (X.mT if dim == -2 else X).to(G.dtype)


def orthogonalize_gathered(G: Tensor, team: Team, orth: Callable[[Tensor], Tensor]) -> Tensor:
    """This member's piece of `orth(W)`, W (`team.shape`) cut along dim `team.dim` into
    `team.pieces` held by group ranks `team.order`, `G` this rank's piece: one all-to-all brings
    the pieces to the first piece's holder, which alone runs `orth` on W, as one owner of W
    would (or as its team's member, `team.inner`); one all-to-all takes each member its piece
    back. Every member calls it in the same order as its other collectives on the group (and the
    first piece's holder `orth`'s); traces under torch.compile."""
    group, me, d = team.group, dist.get_rank(team.group), team.dim
    row = math.prod(team.shape) // team.shape[d]  # elements per index of the cut dim
    sizes = [0] * len(team.order)  # elements per group rank
    for n, r in zip(team.pieces, team.order, strict=True):
        sizes[r] = n * row
    want = (*team.shape[:d], sizes[me] // row, *team.shape[d + 1 :])
    if tuple(G.shape) != want:
        raise ValueError(
            f"orthogonalize_gathered: a piece {tuple(G.shape)} is not group rank {me}'s "
            f"{sizes[me] // row} indices of dim {d} of {tuple(team.shape)}"
        )

    def shaped(flat: Tensor, n: int) -> Tensor:  # a piece of n indices, from its flat values
        return flat.view(*team.shape[:d], n, *team.shape[d + 1 :])

    lead, none = team.order[0], [0] * len(sizes)
    to_lead = [G.numel() if r == lead else 0 for r in range(len(sizes))]
    here = funcol.all_to_all_single(
        G.reshape(-1), sizes if me == lead else none, to_lead, group
    )  # fmt: skip
    if me == lead:
        parts = here.split(sizes)  # by group rank
        pieces = zip(team.pieces, team.order, strict=True)
        W = torch.cat([shaped(parts[r], n) for n, r in pieces], dim=d)
        mine = orth(W).split(list(team.pieces), dim=d)  # by piece
        back = torch.cat([mine[team.order.index(r)].reshape(-1) for r in range(len(sizes))])
    else:
        back = G.new_empty(0)
    out = funcol.all_to_all_single(back, to_lead, sizes if me == lead else none, group)
    return out.view(G.shape)


def _normalize(X: Tensor, eps: float, group: dist.ProcessGroup) -> Tensor:
    """X / max|W| / (‖W / max|W|‖_F + eps) per matrix, W the whole (X: this member's columns,
    fp32 or fp64): each member scales its slice by its own max (entries in [-1, 1], no
    overflow), then one all-gather of (max|X_i|, ‖X_i / max|X_i|‖²) per member and matrix gives
    the whole's max and norm (proofs/team_ns.md claim 1)."""
    a = max_abs(X).clamp_min(torch.finfo(X.dtype).tiny)  # (..., 1, 1)
    Y = X / a  # zeros stay exact zeros
    sq = torch.linalg.vector_norm(Y, dim=(-2, -1)).double().square()
    mine = a[..., 0, 0].double()
    every = funcol.all_gather_single(torch.stack([mine, sq]).unsqueeze(0), 0, group)
    amax = every[:, 0].amax(dim=0)
    norm = (every[:, 1] * (every[:, 0] / amax).square()).sum(dim=0).sqrt()  # ‖W / max|W|‖_F
    return Y.mul_((mine / amax / (norm + eps)).to(X.dtype)[..., None, None])


def _summed_as(part: Tensor, dtype: torch.dtype, group: dist.ProcessGroup) -> Tensor:
    """Σ over the group of the m×m `part` (fp32), rounded to the narrower `dtype`: a
    reduce-scatter of ⌈m/k⌉-row blocks in fp32, each member's block rounded, an all-gather in
    `dtype`. The all-reduce's sum rounded once, as `all_reduce(part).to(dtype)` (to the order
    of the fp32 additions), for (k-1)/k·(4 + itemsize)·m² bytes a member instead of 2·4·m²."""
    k, m, rows = dist.get_world_size(group), part.shape[-2], part.dim() - 2
    h = -(-m // k)
    if k * h != m:  # rows of zeros to k equal blocks
        part = torch.nn.functional.pad(part, (0, 0, 0, k * h - m))
    block = funcol.reduce_scatter_single(part, "sum", rows, group).to(dtype)
    return funcol.all_gather_single(block, rows, group)[..., :m, :]


def _shared_poly(A: Tensor, b: float, c: float, group: dist.ProcessGroup) -> Tensor:
    """b·A + c·A·A for the symmetric m×m A every member holds: member r computes rows
    [r·⌈m/k⌉, (r+1)·⌈m/k⌉) of it (one GEMM with the b·A rows in its accumulation, 2·m³/k
    FLOPs), one all-gather joins them (the last block zero-padded to the others' height)."""
    k, me, m = dist.get_world_size(group), dist.get_rank(group), A.shape[-1]
    h = -(-m // k)
    lo, hi = min(me * h, m), min((me + 1) * h, m)
    rows = A[..., lo:hi, :]
    if A.dim() == 2:
        block = torch.addmm(rows, rows, A, beta=b, alpha=c)
    else:  # any batch dims, as one batch
        r3, a3 = rows.reshape(-1, hi - lo, m), A.reshape(-1, m, m)
        block = torch.baddbmm(r3, r3, a3, beta=b, alpha=c).reshape(rows.shape)
    if hi - lo < h:
        block = torch.nn.functional.pad(block, (0, 0, 0, h - (hi - lo)))
    return funcol.all_gather_single(block, A.dim() - 2, group)[..., :m, :]
