"""dmuon::owner_broadcast_start — dmuon::owner_broadcast, issued now, waited for later.

Arguments as dmuon::owner_broadcast's. Issues every parameter's broadcast asynchronously (in
one fixed order, as owner_broadcast) and returns a ticket (custom_ops._tickets); the full
tensors come from dmuon::collective_wait on that ticket. Between the two, the collectives travel
while the graph computes: the staged Z3 step issues stage i+1's gathers before stage i computes.
`after` orders this op after whatever produced it (the previous collective's ticket).

No autograd (as owner_broadcast). Registered side-effectful and never recomputed.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from . import _tickets
from ._collectives import _group, define_collective
from ._registry import OpSpec, register_op
from .owner_broadcast import split_shapes

define_collective(
    "dmuon::owner_broadcast_start",
    "(Tensor[] locals, int[] shapes, int[] ndims, int[] routes, str group, "
    "Tensor[]? after=None) -> Tensor",
)


@torch.library.impl("dmuon::owner_broadcast_start", "CompositeExplicitAutograd")
def owner_broadcast_start(
    locals: list[Tensor],
    shapes: list[int],
    ndims: list[int],
    routes: list[int],
    group: str,
    after: list[Tensor] | None = None,
) -> Tensor:
    bufs, works = [], []
    for i, (local, shape) in enumerate(zip(locals, split_shapes(shapes, ndims), strict=True)):
        src, is_src, size = routes[6 * i : 6 * i + 3]
        buf = local.clone() if is_src else local.new_empty(shape)
        work = None
        if size > 1:
            pg = _group(group)
            src_rank = dist.get_global_rank(pg, src)
            work = dist.broadcast(buf, src=src_rank, group=pg, async_op=True)
        bufs.append(buf)
        works.append(work)

    def finish() -> list[Tensor]:
        for w in works:
            if w is not None:
                w.wait()
        return bufs

    return _tickets.issue(finish)


@torch.library.register_fake("dmuon::owner_broadcast_start")
def _(locals, shapes, ndims, routes, group, after=None):
    return _tickets.fake_ticket()


def _samples():
    g = torch.Generator().manual_seed(7)
    a, b = torch.randn(6, 4, generator=g), torch.randn(3, generator=g)
    yield ([a, b], [6, 4, 3], [2, 1], [0, 1, 1, 0, 1, 1] * 2, ""), {}


register_op(
    OpSpec(
        "dmuon::owner_broadcast_start",
        torch.ops.dmuon.owner_broadcast_start,
        _samples,
        False,
        ticket=True,
    )
)
