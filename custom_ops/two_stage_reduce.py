"""dmuon::two_stage_reduce — sum full-shape gradients onto their owners, in two stages under HSDP.

For parameter i (routes as in dmuon::owner_broadcast): stage 1 sums over `group` onto rank
src; on that rank (the local owner), stage 2 sums over `rep_group` onto rep_src (the global owner)
when rep_size > 1. The global owner gets scale·Σ over all G·R ranks; every other rank gets zeros
shaped like its local slot (`local_shapes`: full on local owners, 0-size elsewhere), so each
result has the shape of the parameter slot it is a gradient for. One call carries every
parameter, in one fixed order on every rank (see dmuon::owner_broadcast).

No autograd: it transposes the gather for the step's gradient; nothing differentiates it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._collectives import define_collective, reduce_sum
from ._registry import OpSpec, register_op
from .owner_broadcast import split_shapes

define_collective(
    "dmuon::two_stage_reduce",
    "(Tensor[] fulls, int[] local_shapes, int[] ndims, int[] routes, str group, str rep_group, "
    "float scale) -> Tensor[]",
)


@torch.library.impl("dmuon::two_stage_reduce", "CompositeExplicitAutograd")
def two_stage_reduce(
    fulls: list[Tensor],
    local_shapes: list[int],
    ndims: list[int],
    routes: list[int],
    group: str,
    rep_group: str,
    scale: float,
) -> list[Tensor]:
    out = []
    for i, (full, shape) in enumerate(zip(fulls, split_shapes(local_shapes, ndims), strict=True)):
        src, is_src, size, rep_src, is_rep_src, rep_size = routes[6 * i : 6 * i + 6]
        buf = reduce_sum(full.contiguous().clone(), src, group, size)
        if is_src and rep_size > 1:
            buf = reduce_sum(buf, rep_src, rep_group, rep_size)
        if is_src and (rep_size == 1 or is_rep_src):
            out.append(buf.mul_(scale))
        else:
            out.append(full.new_zeros(shape))
    return out


@torch.library.register_fake("dmuon::two_stage_reduce")
def _(fulls, local_shapes, ndims, routes, group, rep_group, scale):
    return [t.new_empty(s) for t, s in zip(fulls, split_shapes(local_shapes, ndims), strict=True)]


def _samples():
    g = torch.Generator().manual_seed(4)
    a, b = torch.randn(6, 4, generator=g), torch.randn(5, generator=g)
    yield ([a, b], [6, 4, 0], [2, 1], [0, 1, 1, 0, 1, 1, 0, 0, 1, 0, 0, 1], "", "", 0.25), {}


register_op(OpSpec("dmuon::two_stage_reduce", torch.ops.dmuon.two_stage_reduce, _samples, False))
