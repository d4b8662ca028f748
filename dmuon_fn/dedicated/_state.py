"""What `dedicate_params` attaches to a model (`DedicatedState`): an `Entry` per dedicated
parameter, held in full between steps by its *local owners* (shard rank `owner_shard` of every
replica; the *global owner* (owner_shard, owner_replica) keeps the master, at least fp32, and the
optimizer state), a 0-size placeholder elsewhere (tensor parallelism: this tensor rank's part).
A `Unit` (one layer's modules, `planning/_layers.layer_keys`) is gathered per `Group`; one
module's groups are its reduce buckets (proofs/dedicated_notes.md)."""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch import Tensor

from custom_ops._collectives import broadcast_into
from custom_ops._collectives import broadcast_start as issue_broadcast

from ..comm._counters import blocked
from ..comm._mesh import phase
from ..ns._team import Team
from ..planning._slices import Piece, make_team
from ..planning._view import RankView
from ..tp._layout import TensorLayout, TensorMesh

STATE_ATTR = "_dmuon_state"
LIVE: weakref.WeakSet = weakref.WeakSet()  # every DedicatedState alive (dedicated/_torch_norms.py)


def broadcast_start(t: Tensor, src: int, group: dist.ProcessGroup, what: str) -> dist.Work | None:
    """Issue the in-place broadcast from group rank `src` (None on a group of one)."""
    with phase(what):
        return issue_broadcast(t, src, group, dist.get_world_size(group))


def wait_work(work: dist.Work, what: str) -> None:
    """Block on `work`, counted as blocked time."""
    with blocked(), phase(what):
        work.wait()


@dataclass(eq=False)
class Entry:
    """One dedicated parameter (tied names share one entry); its owner is the plan's."""

    name: str
    names: tuple[str, ...]
    shape: torch.Size
    dtype: torch.dtype  # compute and gather dtype (the model's, or param_dtype)
    reduce_dtype: torch.dtype
    owner_shard: int
    owner_replica: int
    param: nn.Parameter  # full on local owners (fp32 master on the global owner), else 0-size
    device: torch.device  # param's: compiled hooks read this, never `param`
    tp: TensorLayout | None = None  # tensor parallelism: `shape`/`param` are this rank's part
    piece: Piece | None = None  # a piece (planning/_slices.py): where it is in its parameter
    whole: torch.Size | None = None  # a piece: its parameter's shape
    holder: nn.Parameter | None = None  # a piece: the parameter its module holds on this rank
    publish: dist.Work | None = None  # the HSDP publish into `param` still in flight
    grad_divide: float | None = None  # FSDP2's gradient divide factor of its module (None: mean)
    handles: list[Tensor] = field(default_factory=list)  # one per Slot; backward sets its .grad

    is_matrix = property(lambda self: len(self.shape) >= 2)

    @property
    def full_shape(self) -> torch.Size:
        """The whole parameter's shape (`shape` is a piece's or a tensor rank's part of it)."""
        return self.tp.full_shape if self.tp is not None else self.whole or self.shape

    @property
    def touched(self) -> bool:
        """Backward reached a gather of this parameter since the last step (alike on all ranks)."""
        return any(h.grad is not None for h in self.handles)

    def follow_requires_grad(self) -> None:
        """The handles require grad as `param` does (compiled blocks read the handle's); a piece's
        `param` first as its `holder` does (what the user freezes), alike on every rank."""
        if self.holder is not None:
            self.param.requires_grad_(self.holder.requires_grad)
        for h in self.handles:
            h.requires_grad_(self.param.requires_grad)

    def wait_publish(self) -> None:
        if self.publish is not None:
            wait_work(self.publish, f"the HSDP publish of {self.name}")
            self.publish = None


class Group:
    """Entries with one global owner and dtypes, moved as one flat buffer of `numel` elements
    (entry i at [offsets[i], offsets[i + 1])): a unit's gather group, or a module's bucket."""

    def __init__(self, entries: Sequence[Entry]) -> None:
        self.entries = tuple(entries)
        e0 = self.entries[0]
        self.owner, self.owner_replica, self.device = e0.owner_shard, e0.owner_replica, e0.device
        self.dtype, self.reduce_dtype = e0.dtype, e0.reduce_dtype
        self.offsets = (0, *accumulate(e.shape.numel() for e in self.entries))
        self.numel = self.offsets[-1]
        self.index = {id(e): i for i, e in enumerate(self.entries)}
        self.names = ", ".join(e.name for e in self.entries)
        self.owed = [0] * len(self.entries)  # a bucket's handed-out values owing a gradient
        self.flat: Tensor | None = None  # their sum (kept across passes while sync is off)
        self.has = [False] * len(self.entries)  # which entries the sum holds

    def part(self, flat: Tensor, i: int) -> Tensor:
        return flat[self.offsets[i] : self.offsets[i + 1]].view(self.entries[i].shape)


@dataclass(eq=False)
class Unit:
    key: str
    groups: tuple[Group, ...]
    owed_regathers: int = 0  # Z3 backward: re-gathered values still to be taken
    handles: list[Tensor] = field(default_factory=list)  # of its slots (dedicated/_dedicate.py)


def make_groups(entries: Sequence[Entry]) -> tuple[Group, ...]:
    """`entries` (each once) grouped by (global owner, dtypes, device), ordered by owner."""
    groups: dict[tuple, list[Entry]] = {}
    for e in dict.fromkeys(entries):
        key = ((e.owner_shard, e.owner_replica), e.dtype, e.reduce_dtype, e.device)
        groups.setdefault(key, []).append(e)
    return tuple(Group(m) for _, m in sorted(groups.items(), key=lambda kv: kv[0][0]))


@dataclass(eq=False)
class DedicatedState:
    view: RankView
    shard_group: dist.ProcessGroup
    replicate_group: dist.ProcessGroup | None
    reshard_after_forward: bool
    tensor: TensorMesh | None = None  # the tensor-parallel ranks
    entries: list[Entry] = field(default_factory=list)
    by_param: dict[int, Entry] = field(default_factory=dict)  # id(param) -> its entry
    scheduler: Any = None  # dedicated/_schedule.Scheduler, set by dedicated/_hooks.install
    # key -> (group, the group rank of each piece) of my teams (key: the matrix) and gathered
    # groups (key: the first piece)
    teams: dict[str, tuple[dist.ProcessGroup, tuple[int, ...]]] = field(default_factory=dict)
    unsynced: bool = False  # copies of held values not made equal yet (`sync_copies`)

    def team(self, e: Entry) -> Team | None:
        """What `e` passes `muon_update` as its team (a team's or gathered group's), else None."""
        return make_team(self.plan, e.name, self.teams)

    plan = property(lambda self: self.view.plan)
    shard_size = property(lambda self: self.view.plan.shard_size)
    replicate_size = property(lambda self: self.view.plan.replicate_size)

    def entry(self, p: Tensor) -> Entry | None:
        return self.by_param.get(id(p))

    def is_local_owner(self, e: Entry) -> bool:
        return e.owner_shard == self.view.shard_rank

    def is_global_owner(self, e: Entry) -> bool:
        return e.owner_shard == self.view.shard_rank and e.owner_replica == self.view.replica_rank

    def on_meta(self) -> bool:
        """Whether the held values are still on the meta device (alike on every rank: a meta
        model's before `model.to_empty`)."""
        return any(e.param.is_meta for e in self.entries)

    def sync_copies(self, where: str) -> None:
        """Make the copies of every held value equal, once: TP's whole copies take tensor rank
        0's, HSDP's local owners the global owner's (cast). A meta model's wait until it has
        storage (`to_empty`) and values (its init): the first of `init_weights`, `Muon` and the
        first forward runs them."""
        if not self.unsynced or self.on_meta():
            return
        for e in self.entries:
            if e.param.device != e.device:
                raise ValueError(
                    f"{e.name} is on {e.param.device} but its mesh computes on {e.device}: "
                    f"materialize the model with model.to_empty(device={str(e.device)!r})"
                )
        self.unsynced = False
        mine, tp = [e for e in self.entries if self.is_local_owner(e)], self.tensor
        for e in mine:
            if tp is not None and not e.tp.sharded:
                with phase(f"{where} (tensor-parallel sync of {e.name})"):
                    broadcast_into(e.param.detach(), 0, tp.group, tp.size)
        rep = self.replicate_group
        for e in mine if rep is not None else ():
            with phase(f"{where} (replica sync of {e.name})"):  # (the owner sends a cast copy)
                broadcast_into(e.param.detach().to(e.dtype), e.owner_replica, rep, rep.size())

    def publish(self, asynchronous: bool) -> None:
        """After a step: entries forget `touched`; HSDP: the touched ones' local owners take the
        global owner's value (`asynchronous`: waited for before their next gather or update)."""
        for e in self.entries:
            touched = e.touched
            for h in e.handles:
                h.grad = None
            e.follow_requires_grad()
            if self.replicate_group is None or not (self.is_local_owner(e) and touched):
                continue
            e.wait_publish()
            # the global owner sends a cast copy of its fp32 master; `to` is a no-op elsewhere
            buf = e.param.detach().to(e.dtype)
            what = f"step (HSDP publish of {e.name})"
            e.publish = broadcast_start(buf, e.owner_replica, self.replicate_group, what)
            if not asynchronous:
                e.wait_publish()


def dedicated_state(model: nn.Module, required: bool = False) -> DedicatedState | None:
    st = getattr(model, STATE_ATTR, None)
    if st is None and required:
        raise ValueError("this model has no dedicated parameters: call dedicate_params first")
    return st
