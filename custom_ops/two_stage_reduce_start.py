"""dmuon::two_stage_reduce_start — dmuon::two_stage_reduce, issued now, waited for later.

Arguments as dmuon::two_stage_reduce's (plus `after`, as dmuon::owner_broadcast_start's).
Issues stage 1 (the sums over `group` onto each local owner) asynchronously and returns a
ticket; dmuon::collective_wait on it waits for stage 1, runs stage 2 (across `rep_group` onto
the global owner, HSDP only) and returns what two_stage_reduce returns: scale·Σ on each global
owner, zeros shaped like the local slot elsewhere. The gradients are copied when issued, so
the caller's full-shape gradients can go at once.

No autograd (as two_stage_reduce). Registered side-effectful and never recomputed.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import _tickets
from ._collectives import _group, define_collective, reduce_start, reduce_sum
from ._registry import OpSpec, register_op
from .owner_broadcast import split_shapes

define_collective(
    "dmuon::two_stage_reduce_start",
    "(Tensor[] fulls, int[] local_shapes, int[] ndims, int[] routes, str group, str rep_group, "
    "float scale, Tensor[]? after=None) -> Tensor",
)


@torch.library.impl("dmuon::two_stage_reduce_start", "CompositeExplicitAutograd")
def two_stage_reduce_start(
    fulls: list[Tensor],
    local_shapes: list[int],
    ndims: list[int],
    routes: list[int],
    group: str,
    rep_group: str,
    scale: float,
    after: list[Tensor] | None = None,
) -> Tensor:
    shapes = split_shapes(local_shapes, ndims)
    bufs, works = [], []
    for i, full in enumerate(fulls):
        src, _, size = routes[6 * i : 6 * i + 3]
        buf = full.contiguous().clone()
        work = None
        if size > 1:
            work = reduce_start(buf, src, _group(group))
        bufs.append(buf)
        works.append(work)

    def finish() -> list[Tensor]:
        out = []
        for i, (buf, work, shape) in enumerate(zip(bufs, works, shapes, strict=True)):
            _, is_src, _, rep_src, is_rep_src, rep_size = routes[6 * i : 6 * i + 6]
            if work is not None:
                work.wait()
            if is_src and rep_size > 1:
                buf = reduce_sum(buf, rep_src, rep_group, rep_size)
            if is_src and (rep_size == 1 or is_rep_src):
                out.append(buf.mul_(scale))
            else:
                out.append(buf.new_zeros(shape))
        return out

    return _tickets.issue(finish)


@torch.library.register_fake("dmuon::two_stage_reduce_start")
def _(fulls, local_shapes, ndims, routes, group, rep_group, scale, after=None):
    return _tickets.fake_ticket()


def _samples():
    g = torch.Generator().manual_seed(8)
    a, b = torch.randn(6, 4, generator=g), torch.randn(5, generator=g)
    routes = [0, 1, 1, 0, 1, 1, 0, 0, 1, 0, 0, 1]
    yield ([a, b], [6, 4, 0], [2, 1], routes, "", "", 0.25), {}


register_op(
    OpSpec(
        "dmuon::two_stage_reduce_start",
        torch.ops.dmuon.two_stage_reduce_start,
        _samples,
        False,
        ticket=True,
    )
)
