"""dmuon::collective_wait — the results of an asynchronous collective op, once landed.

ticket: a dmuon::*_start op's, redeemed once; like[i]: a tensor (0-size will do) of output i's dtype
and device; shapes/ndims: the outputs' shapes, flattened as in dmuon::owner_broadcast; `after`
orders the wait after the computation the collectives overlap. Returns the outputs in order. No
autograd; side-effectful: a rank that drops the result still waits."""

from __future__ import annotations

import torch
from torch import Tensor

from ._collectives import define_collective, issue_ticket, new_empty, redeem, split_shapes
from ._registry import OpSpec, register_op

define_collective(
    "dmuon::collective_wait",
    "(Tensor ticket, Tensor[] like, int[] shapes, int[] ndims, Tensor[]? after=None) -> Tensor[]",
)


@torch.library.impl("dmuon::collective_wait", "CompositeExplicitAutograd")
def collective_wait(
    ticket: Tensor,
    like: list[Tensor],
    shapes: list[int],
    ndims: list[int],
    after: list[Tensor] | None = None,
) -> list[Tensor]:
    out = redeem(ticket)
    for t, ref, shape in zip(out, like, split_shapes(shapes, ndims), strict=True):
        if list(t.shape) != shape or t.dtype != ref.dtype or t.device != ref.device:
            raise RuntimeError(
                f"dmuon::collective_wait: got {tuple(t.shape)} {t.dtype} on {t.device}, the "
                f"graph expected {tuple(shape)} {ref.dtype} on {ref.device}"
            )
    return out


@torch.library.register_fake("dmuon::collective_wait")
def _(ticket, like, shapes, ndims, after=None):
    return new_empty(like, shapes, ndims)


def _samples():
    g = torch.Generator().manual_seed(9)
    a, b = torch.randn(6, 4, generator=g), torch.randn(3, generator=g)
    ticket = issue_ticket(lambda: [a.clone(), b.clone()], once=False)  # as a start op's
    yield (ticket, [a.new_empty(0), b.new_empty(0)], [6, 4, 3], [2, 1]), {}


register_op(OpSpec("dmuon::collective_wait", torch.ops.dmuon.collective_wait, _samples, False))
