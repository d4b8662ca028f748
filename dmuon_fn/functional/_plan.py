"""The functional API's plan: `plan` makes the `FnPlan` (who owns what, for one rank)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from ..comm._mesh import check_dtypes, check_meshes, team_groups
from ..dedicated import _fsdp_adapter as fsdp
from ..ns._blocks import Blocks, model_blocks
from ..ns._dispatch import agreed_gram, gram_rule
from ..ns._team import Team
from ..planning._check import check_plan_consistent
from ..planning._partition import partition
from ..planning._slices import make_team
from ..planning._summary import PlanSummary, plan_summary
from ..planning._view import RankView


@dataclass(frozen=True)
class FnPlan:
    """Who owns what, for this rank: plain data, hashable, a compile-time constant."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    muon: frozenset[str]
    trainable: frozenset[str]  # requires_grad at plan time; `update` leaves the rest as they are
    view: RankView  # the job's plan, seen from this rank
    group: str
    rep_group: str
    param_dtype: torch.dtype | None = None  # what is gathered and computed with
    reduce_dtype: torch.dtype | None = None  # what gradients are summed in (None: param_dtype)
    # (key, (group, the group rank of each piece)) per team or gathered group I am in
    teams: tuple[tuple[str, tuple[dist.ProcessGroup, tuple[int, ...]]], ...] = ()

    partition = property(lambda self: self.view.plan)
    shard_size = property(lambda self: self.view.plan.shard_size)
    replicate_size = property(lambda self: self.view.plan.replicate_size)
    route = property(lambda self: self.view.route)  # of a plan name (a parameter or a piece)

    def is_local_owner(self, name: str) -> bool:
        """Whether this rank holds parameter `name` (a sliced one: a piece) between steps."""
        return self.view.held(name) is not None

    def is_global_owner(self, name: str) -> bool:
        """Whether this rank updates (what it holds of) parameter `name`."""
        held = self.view.held(name)
        return held is not None and self.view.is_global_owner(held)

    def pieces(self, names) -> list[tuple[str, str]]:
        """(parameter, plan name) of every piece of `names` in order, a parameter not sliced
        being its one piece (its own name)."""
        return [(n, p) for n in names for p in self.partition.pieces(n)]

    def team(self, name: str) -> Team | None:
        """What this rank's piece of `name` passes `muon_update` as its team (a team's or a
        gathered group's), if it is in one."""
        held = self.view.held(name)
        return None if held is None else make_team(self.partition, held, dict(self.teams))

    def held_shape(self, name: str) -> tuple[int, ...]:
        """The shape of what this rank holds of parameter `name` ((0,) if nothing)."""
        held = self.view.held(name)
        return (0,) if held is None else self.partition.shape(held)

    def compute(self, t: torch.Tensor) -> torch.Tensor:
        """A held value (master or placeholder) as it is gathered: in `param_dtype`."""
        return t if self.param_dtype is None else t.to(self.param_dtype)

    def summed(self, g: torch.Tensor) -> torch.Tensor:
        """A gradient as it is reduced: in `reduce_dtype` (default `param_dtype`)."""
        dt = self.reduce_dtype or self.param_dtype
        return g if dt is None else g.to(dt)

    def summary(self, gemm_flops: float | None = None) -> PlanSummary:
        """`plan_summary` of this plan (`str`: a table)."""
        return plan_summary(self.partition, gemm_flops=gemm_flops)

    def __str__(self) -> str:
        return str(self.summary())

    def shape(self, name: str) -> tuple[int, ...]:
        return self.shapes[self.names.index(name)]


def plan(
    model: nn.Module,
    mesh: DeviceMesh | None = None,
    predicate: Callable[[str, nn.Parameter], bool] | None = None,
    *,
    replicate_mesh: DeviceMesh | None = None,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    blocks: Mapping[str, Blocks | str] | None = None,
    teams: Mapping[str, int] | None = None,
    max_bytes_per_rank: int | None = None,
) -> FnPlan:
    """Plan ownership of every parameter of `model` (`named_parameters()` order); mesh None: one
    process. predicate(name, param) picks the Muon matrices (default: 2+ dims), the rest AdamW.
    Mixed precision as `dedicate_params`: parameters gathered and computed with in `param_dtype`,
    the global owner's master in the model dtype (at least fp32), gradients summed in
    `reduce_dtype` (default param_dtype); None: the model dtype throughout, no master.
    blocks: {name or fnmatch pattern: `Blocks` spec} for matrices made of several (experts,
    fused qkv, heads); default: conv weights one flattened matrix, other 3+-D parameters a
    batch of matrices over their leading dims (ns/_blocks.py). teams: {name: k} puts a matrix
    on a team of k (`partition`'s). max_bytes_per_rank: a cap on each rank's resident bytes,
    as `dedicate_params`'s."""
    check_dtypes(param_dtype, reduce_dtype)
    named = list(model.named_parameters())
    if not named:
        raise ValueError("the model has no parameters to plan")
    split = [n for n, p in named if fsdp.is_dtensor(p)]
    if split:
        raise ValueError(
            f"{split[0]} is a DTensor ({len(split)} in all): the functional API plans plain "
            "tensors. For tensor parallelism use the object API (parallelize_module, then "
            "dedicate_params and Muon)"
        )
    predicate = predicate or (lambda n, p: p.ndim >= 2)
    muon = frozenset(n for n, p in named if predicate(n, p))
    bad = [n for n, p in named if n in muon and p.ndim < 2]
    if bad:
        raise ValueError(f"{bad[0]} is not a matrix: the predicate must select 2+-dim params")
    if mesh is None and replicate_mesh is not None:
        raise ValueError("replicate_mesh needs a shard mesh too")
    if mesh is not None:
        check_meshes(mesh, replicate_mesh)
    (G, shard_rank, group), (R, rep_rank, rep_group) = (
        (1, 0, "") if m is None else (m.size(), m.get_local_rank(), m.get_group().group_name)
        for m in (mesh, replicate_mesh)
    )
    shapes, device = {n: tuple(p.shape) for n, p in named}, named[0][1].device
    rule = agreed_gram(device) if G * R > 1 else gram_rule(device)  # rank 0's in a job
    adamw = [n for n in shapes if n not in muon]
    specs = model_blocks(model, sorted(muon), blocks)
    part = partition(
        shapes,
        G * R,
        replicate_size=R,
        elementwise=adamw,
        **rule,
        blocks=specs,
        teams=teams,
        max_bytes_per_rank=max_bytes_per_rank,
    )
    mine = {}
    if dist.is_initialized() and G * R > 1:
        check_plan_consistent(part)
        mine = team_groups(part, shard_rank, rep_rank)
    names, shapes = tuple(shapes), tuple(shapes.values())
    trainable = frozenset(n for n, p in named if p.requires_grad)
    view = RankView(part, shard_rank, rep_rank)
    return FnPlan(
        *(names, shapes, muon, trainable, view, group, rep_group, param_dtype, reduce_dtype),
        tuple(sorted(mine.items())),
    )
