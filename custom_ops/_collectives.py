"""Blocking c10d collectives behind the communication ops and dmuon_fn's object API.

Groups are a ProcessGroup or its name (ops can carry only the name in their schema). Inside an
op the collective is opaque to tracing: a compiled graph calls the op, the op calls c10d. A group
of size 1 returns at once without torch.distributed.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

Group = dist.ProcessGroup | str


def _group(group: Group) -> dist.ProcessGroup:
    if isinstance(group, str):
        return dist.distributed_c10d._resolve_process_group(group)
    return group


def broadcast_into(t: Tensor, src: int, group: Group, size: int) -> Tensor:
    """In place, from group rank `src`."""
    if size > 1:
        pg = _group(group)
        dist.broadcast(t, src=dist.get_global_rank(pg, src), group=pg)
    return t


def reduce_sum(t: Tensor, dst: int, group: Group, size: int) -> Tensor:
    """In place, the sum onto group rank `dst` (gloo has no AVG: callers scale once after)."""
    if size > 1:
        reduce_start(t, dst, _group(group)).wait()
    return t


# the tag of the pair reduce's transfers: apart from tag 0, which user code sends on
PAIR_TAG = 0x6D75


class PairReduce:
    """A sum onto one rank of a gloo group of two, as one transfer: the other rank sends its
    buffer, the owner receives it into a buffer of its own and adds it on `wait`.

    gloo's reduce moves 1.5-2.2x the payload through the network for two ranks (measured on a
    loopback's byte counters: ring phases in both directions), a transfer moves it once. The
    owner's result is the same bits: a sum of two terms does not depend on their order. Each
    reduce has both ranks of the pair at its two ends, and gloo matches one pair's transfers of
    one tag in issue order, so every rank issuing its reduces in one program order pairs them up
    as collectives would.
    """

    def __init__(self, t: Tensor, peer: int, pg: dist.ProcessGroup, owner: bool) -> None:
        self.t = t
        self.inbox = torch.empty_like(t) if owner else None
        if owner:
            self.work = dist.irecv(self.inbox, src=peer, group=pg, tag=PAIR_TAG)
        else:
            self.work = dist.isend(t, dst=peer, group=pg, tag=PAIR_TAG)

    def wait(self) -> bool:
        if self.work is not None:
            self.work.wait()
            self.work = None
            if self.inbox is not None:
                self.t.add_(self.inbox)
                self.inbox = None
        return True


def _gloo(pg: dist.ProcessGroup, device: torch.device) -> bool:
    """Whether `pg` runs collectives on tensors of `device` with gloo."""
    backend = str(dist.get_backend(pg))
    if ":" not in backend:  # one backend for every device
        return backend == "gloo"
    table = dict(part.split(":") for part in backend.split(","))  # "cpu:gloo,cuda:nccl"
    return table.get(device.type) == "gloo"


def reduce_start(t: Tensor, dst: int, pg: dist.ProcessGroup):
    """Issue the sum of `t` over `pg` onto group rank `dst`, in place there (other ranks' `t`
    is left undefined, as dist.reduce leaves it); returns a work whose `wait` lands it. Over two
    gloo ranks one transfer (`PairReduce`), else dist.reduce."""
    if dist.get_world_size(pg) == 2 and t.device.type == "cpu" and _gloo(pg, t.device):
        me = dist.get_rank(pg)
        return PairReduce(t, dist.get_global_rank(pg, 1 - me), pg, owner=me == dst)
    dst_global = dist.get_global_rank(pg, dst)
    return dist.reduce(t, dst=dst_global, op=dist.ReduceOp.SUM, group=pg, async_op=True)


def define_collective(qualname: str, schema: str) -> None:
    """torch.library.define for an op that issues collectives.

    Defined with torch.library.define rather than custom_op: custom_op wraps every call in an
    autograd.Function without setup_context, which torch.func's transforms reject, and these
    ops run inside functions that torch.func differentiates. Tagged never to be recomputed by
    graph partitioners and registered side-effectful, so it is never dead-code eliminated where
    a rank ignores its result: the other ranks would wait for it forever.
    """
    torch.library.define(qualname, schema, tags=(torch.Tag.nondeterministic_seeded,))
    ns, name = qualname.split("::")
    torch.fx.node.has_side_effect(getattr(getattr(torch.ops, ns), name).default)
