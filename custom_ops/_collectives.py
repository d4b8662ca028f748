"""c10d collectives behind the communication ops and the object API; `define_async`, which defines
every op that issues collectives, and its _start ops' tickets. A group is a ProcessGroup or its
name (ops carry names); size 1 needs no torch.distributed (proofs/custom_ops_notes.md)."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import Tensor

from ._registry import OpSpec, Sample, register_op

Group = dist.ProcessGroup | str
Finish = Callable[[], list[Tensor]]  # what `issue` returns: waits, returns the results
_PENDING: dict[int, tuple[Finish, bool]] = {}
_NEXT_TICKET = itertools.count(1)


def issue_ticket(finish: Finish, *, once: bool = True) -> Tensor:
    """`finish`'s new ticket, a (1,) int64 CPU tensor; once=False: redeemable again and again."""
    key = next(_NEXT_TICKET)
    _PENDING[key] = (finish, once)
    with torch.profiler.record_function("dmuon::ticket"):  # its own label: not a gathered copy
        return torch.tensor([key], dtype=torch.int64, device="cpu")


def redeem(ticket: Tensor) -> list[Tensor]:
    """The results of the collectives behind `ticket` (waits for them)."""
    key = int(ticket.item())
    if key not in _PENDING:
        raise RuntimeError(f"dmuon: ticket {key} was already redeemed or never issued")
    finish, once = _PENDING[key]
    if once:
        del _PENDING[key]
    return finish()


def _group(group: Group) -> dist.ProcessGroup:
    return dist.distributed_c10d._resolve_process_group(group) if isinstance(group, str) else group


def broadcast_start(t: Tensor, src: int, group: Group, size: int):
    """Issue the broadcast of `t`, in place, from group rank `src`: its work (None for size 1)."""
    if size == 1:
        return None
    pg = _group(group)
    return dist.broadcast(t, src=dist.get_global_rank(pg, src), group=pg, async_op=True)


def broadcast_into(t: Tensor, src: int, group: Group, size: int) -> Tensor:
    """In place, from group rank `src`; returns `t` once it has landed."""
    wait_all([broadcast_start(t, src, group, size)])
    return t


def wait_all(works: Iterable) -> None:
    for w in works:
        if w is not None:
            w.wait()


SEND_TAG = 0x6D75  # the pair reduce's transfers: apart from tag 0, on which user code sends
# the largest gloo group whose reduces go as direct transfers (the owner holds group - 1 inboxes):
# four reduces of 64-256 KB took 1.4 ms against gloo's reduce 12 ms on 4 ranks, 4.4 against 55 ms
# on 8 (BENCHMARKS.md, issue 27); larger groups were not measured.
SEND_REDUCE_MAX = 8


class SendReduce:
    """A sum onto one rank of a small gloo group (2 to `SEND_REDUCE_MAX` ranks) as direct
    transfers, several times faster than gloo's reduce: every other rank sends `t`, the owner
    receives each into a buffer of its own and, on `wait`, adds them to its `t` in group-rank
    order (over two ranks the same bits as a reduce: one addition, which commutes)."""

    def __init__(self, t: Tensor, dst: int, pg: dist.ProcessGroup) -> None:
        me, size = dist.get_rank(pg), dist.get_world_size(pg)
        self.t, self.inbox = t, []
        if me == dst:
            peers = [r for r in range(size) if r != me]
            self.inbox = [torch.empty_like(t) for _ in peers]
            self.works = [
                dist.irecv(b, src=dist.get_global_rank(pg, r), group=pg, tag=SEND_TAG)
                for b, r in zip(self.inbox, peers, strict=True)
            ]
        else:
            peer = dist.get_global_rank(pg, dst)
            self.works = [dist.isend(t, dst=peer, group=pg, tag=SEND_TAG)]

    def wait(self) -> bool:
        for w in self.works:
            w.wait()
        for b in self.inbox:
            self.t.add_(b)
        self.works, self.inbox = [], []
        return True


def _gloo(pg: dist.ProcessGroup, device: torch.device) -> bool:
    backend = str(dist.get_backend(pg))  # "gloo", or one per device: "cpu:gloo,cuda:nccl"
    per_device = dict(part.split(":") for part in backend.split(",")) if ":" in backend else {}
    return per_device.get(device.type, backend) == "gloo"


def reduce_start(t: Tensor, dst: int, pg: dist.ProcessGroup):
    """Issue the sum of `t` over `pg` onto group rank `dst`, in place there (other ranks' `t`
    undefined, as with dist.reduce); returns a work whose `wait` lands it."""
    size = dist.get_world_size(pg)
    if 2 <= size <= SEND_REDUCE_MAX and t.device.type == "cpu" and _gloo(pg, t.device):
        return SendReduce(t, dst, pg)
    return dist.reduce(t, dst=dist.get_global_rank(pg, dst), group=pg, async_op=True)


def split_shapes(shapes: list[int], ndims: list[int]) -> list[list[int]]:
    """The flattened `shapes` cut into one shape per tensor, tensor i having ndims[i] dims."""
    ends = itertools.accumulate(ndims)
    return [list(shapes[end - nd : end]) for end, nd in zip(ends, ndims, strict=True)]


def per_param(tensors: list[Tensor], shapes: list[int], ndims: list[int], routes: list[int]):
    """(tensor, shape, route) per parameter: `shapes` cut by `split_shapes`, `routes` by six."""
    routes_ = [tuple(routes[i : i + 6]) for i in range(0, len(routes), 6)]
    return zip(tensors, split_shapes(shapes, ndims), routes_, strict=True)


def new_empty(like: list[Tensor], shapes: list[int], ndims: list[int]) -> list[Tensor]:
    """Empty tensors of the shapes `split_shapes` gives, each in like[i]'s dtype and device."""
    return [t.new_empty(s) for t, s in zip(like, split_shapes(shapes, ndims), strict=True)]


def define_collective(qualname: str, schema: str, *, seeded: bool = True) -> None:
    """torch.library.define for an op that issues collectives: never dead-code eliminated and,
    tagged `seeded`, never recomputed by graph partitioners."""
    tags = (torch.Tag.nondeterministic_seeded,) if seeded else ()
    torch.library.define(qualname, schema, tags=tags)
    ns, name = qualname.split("::")
    torch.fx.node.has_side_effect(getattr(getattr(torch.ops, ns), name).default)


def define_async(
    name: str,
    args: str,
    issue: Callable[..., Finish],
    fake: Callable[..., list[Tensor]],
    samples: Callable[[], Iterable[Sample]],
    start_args: str | None = None,
) -> None:
    """Define and register, from `issue(*args)` -> Finish: dmuon::<name> (`args` -> Tensor[],
    faked by `fake`), the results; dmuon::<name>_start (`start_args`, default `args`), a ticket
    that dmuon::collective_wait redeems for them."""
    blocking, start = f"dmuon::{name}", f"dmuon::{name}_start"
    define_collective(blocking, f"({args}) -> Tensor[]")
    define_collective(start, f"({start_args or args}) -> Tensor")
    impl = "CompositeExplicitAutograd"
    torch.library.impl(blocking, impl)(lambda *a, **kw: issue(*a, **kw)())
    torch.library.impl(start, impl)(lambda *a, **kw: issue_ticket(issue(*a, **kw)))
    torch.library.register_fake(blocking)(fake)
    torch.library.register_fake(start)(
        lambda *a, **kw: torch.empty(1, dtype=torch.int64, device="cpu")
    )
    register_op(OpSpec(blocking, getattr(torch.ops.dmuon, name), samples, False))
    op = getattr(torch.ops.dmuon, f"{name}_start")
    register_op(OpSpec(start, op, samples, False, ticket=True))
