"""The object API's records: an `Entry` per dedicated parameter, the `Topology` it moves over,
the `Group`s and `Unit`s it moves in, and the asynchronous broadcast every move is made of.

The *local owner* (shard rank `owner_shard` of every replica) holds the full parameter between
steps, the *global owner* (owner_shard, owner_replica) holds it in fp32 with its optimizer state,
every other rank a 0-size placeholder; under tensor parallelism, this tensor rank's part. A
*unit* (one layer's modules, keyed as `planning/_partition.layer_keys` keys layers) is gathered
per `Group` of its entries; one module's groups are its reduce buckets (proofs/dedicated_notes.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import accumulate

import torch
import torch.distributed as dist
import torch.nn as nn
from torch import Tensor

from custom_ops._collectives import broadcast_start as issue_broadcast

from ..comm._counters import blocked
from ..comm._errors import phase
from ..planning._view import RankView
from ..tp._layout import TensorLayout


def broadcast_start(t: Tensor, src: int, group: dist.ProcessGroup, what: str) -> dist.Work | None:
    """custom_ops' broadcast of `t` from group rank `src`, in place (None on a group of one); a
    failure names `what`."""
    with phase(what):
        return issue_broadcast(t, src, group, dist.get_world_size(group))


def wait_work(work: dist.Work, what: str) -> None:
    """Block on `work`, counted as blocked time; a failure names `what`."""
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
    publish: dist.Work | None = None  # the HSDP publish into `param` still in flight
    # one custom_ops._handles handle per module slot (dedicated/_gather.Slot), requiring grad as
    # `param` does; backward sets its .grad when it reaches that slot's gather
    handles: list[torch.Tensor] = field(default_factory=list)
    device: torch.device | None = None  # param's: compiled hooks read this, never `param`
    tp: TensorLayout | None = None  # tensor parallelism: `shape`/`param` are this rank's part

    @property
    def is_matrix(self) -> bool:
        return len(self.shape) >= 2

    @property
    def full_shape(self) -> torch.Size:
        return self.shape if self.tp is None else self.tp.full_shape

    @property
    def touched(self) -> bool:
        """Backward reached a gather of this parameter since the last step (alike on all ranks)."""
        return any(h.grad is not None for h in self.handles)

    def next_step(self) -> None:
        """Forget `touched`; follow `param.requires_grad`."""
        for h in self.handles:
            h.grad = None
        self.follow_requires_grad()

    def follow_requires_grad(self) -> None:
        """The handles require grad as `param` does (compiled blocks read the handle's)."""
        for h in self.handles:
            if h.requires_grad != self.param.requires_grad:
                h.requires_grad_(self.param.requires_grad)

    def wait_publish(self) -> None:
        if self.publish is not None:
            wait_work(self.publish, f"the HSDP publish of {self.name}")
            self.publish = None


@dataclass(eq=False)
class Topology:
    """The groups dedicated parameters move over, and this rank's view of the plan."""

    view: RankView
    shard_group: dist.ProcessGroup
    replicate_group: dist.ProcessGroup | None
    reshard_after_forward: bool

    plan = property(lambda self: self.view.plan)
    shard_size = property(lambda self: self.view.plan.shard_size)
    replicate_size = property(lambda self: self.view.plan.replicate_size)

    # an entry's owner was read from this view when it was made: compare, no plan lookup
    def is_local_owner(self, e: Entry) -> bool:
        return e.owner_shard == self.view.shard_rank

    def is_global_owner(self, e: Entry) -> bool:
        return e.owner_shard == self.view.shard_rank and e.owner_replica == self.view.replica_rank


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
        # a bucket's backward: handed-out values per entry still owing a gradient; the sum of
        # the gradients (kept across passes while sync is off), and which entries it holds
        self.owed = [0] * len(self.entries)
        self.flat: Tensor | None = None
        self.has = [False] * len(self.entries)

    def part(self, flat: Tensor, i: int) -> Tensor:
        return flat[self.offsets[i] : self.offsets[i + 1]].view(self.entries[i].shape)

    @property
    def names(self) -> str:
        return ", ".join(e.name for e in self.entries)


@dataclass(eq=False)
class Unit:
    key: str
    groups: tuple[Group, ...]
    owed_regathers: int = 0  # Z3 backward: re-gathered values still to be taken
    handles: list[Tensor] = field(default_factory=list)  # of its slots (dedicated/_gather.py)


def make_groups(entries: Sequence[Entry]) -> tuple[Group, ...]:
    """`entries` (each once) grouped by (global owner, dtypes, device), ordered by owner."""
    groups: dict[tuple, list[Entry]] = {}
    for e in entries:
        key = ((e.owner_shard, e.owner_replica), e.dtype, e.reduce_dtype, e.device)
        members = groups.setdefault(key, [])
        if all(m is not e for m in members):
            members.append(e)
    return tuple(Group(m) for _, m in sorted(groups.items(), key=lambda kv: kv[0][0]))
