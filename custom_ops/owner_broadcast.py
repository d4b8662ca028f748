"""dmuon::owner_broadcast — each parameter's full tensor, from its owner, on every rank of a group.

One call carries every parameter of a step, so the collectives run in one fixed order on every
rank whatever a graph scheduler does with the rank-specific graphs around it (a non-owner's graph
differs from the owner's).

locals[i]: the full tensor on parameter i's source rank, a 0-size placeholder elsewhere.
shapes: the full shapes, flattened, with ndims[i] entries for parameter i.
routes: 6 ints per parameter, (src, is_src, group_size, rep_src, is_rep_src, rep_size): the
source's rank in `group` and whether this rank is it; the last three are for the transpose,
dmuon::two_stage_reduce (rep_size 1: no second stage). Group arguments are process-group names;
a group of size 1 never touches torch.distributed. `after` is read by nobody: it orders this call
after whatever produced it (the publish after the step's gradient reduce).
Returns the full tensors, in order.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._collectives import broadcast_into, define_collective
from ._registry import OpSpec, register_op

define_collective(
    "dmuon::owner_broadcast",
    "(Tensor[] locals, int[] shapes, int[] ndims, int[] routes, str group, "
    "Tensor[]? after=None) -> Tensor[]",
)


def split_shapes(shapes: list[int], ndims: list[int]) -> list[list[int]]:
    out, i = [], 0
    for nd in ndims:
        out.append(list(shapes[i : i + nd]))
        i += nd
    return out


@torch.library.impl("dmuon::owner_broadcast", "CompositeExplicitAutograd")
def owner_broadcast(
    locals: list[Tensor],
    shapes: list[int],
    ndims: list[int],
    routes: list[int],
    group: str,
    after: list[Tensor] | None = None,
) -> list[Tensor]:
    out = []
    for i, (local, shape) in enumerate(zip(locals, split_shapes(shapes, ndims), strict=True)):
        src, is_src, size = routes[6 * i : 6 * i + 3]
        buf = local.clone() if is_src else local.new_empty(shape)
        out.append(broadcast_into(buf, src, group, size))
    return out


@torch.library.register_fake("dmuon::owner_broadcast")
def _(locals, shapes, ndims, routes, group, after=None):
    return [t.new_empty(s) for t, s in zip(locals, split_shapes(shapes, ndims), strict=True)]


# No autograd: the step gathers outside the differentiated function and reduces the gradients
# of the gathered tensors with dmuon::two_stage_reduce afterwards (dmuon_fn.functional._step).


def _samples():
    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(6, 4, generator=g), torch.randn(3, generator=g)
    yield ([a, b], [6, 4, 3], [2, 1], [0, 1, 1, 0, 1, 1] * 2, ""), {}
    yield ([a], [6, 4], [2], [0, 1, 1, 0, 1, 1], ""), {"after": [b]}


register_op(OpSpec("dmuon::owner_broadcast", torch.ops.dmuon.owner_broadcast, _samples, False))
