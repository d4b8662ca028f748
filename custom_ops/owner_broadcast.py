"""dmuon::owner_broadcast — the owner's full tensor on every rank of a group; its transpose is
dmuon::two_stage_reduce (sum onto the owner, then onto the global owner).

local: the full tensor on the source rank, a 0-size placeholder elsewhere. shape: the full shape.
route = [src, is_src, group_size, rep_src, is_rep_src, rep_size] as ints: the source's rank in
`group` and whether this rank is it; for the backward's second stage (HSDP), the global owner's
rank in `rep_group` and whether this rank is it (rep_size 1: no second stage). `scale` multiplies
the reduced gradient (1/(G·R) for the data-parallel mean).
Returns the full tensor (shape, local's dtype). Group arguments are process-group names; a group
of size 1 never touches torch.distributed. World-size dependent values arrive as explicit ints.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._collectives import broadcast_into
from ._registry import OpSpec, register_op

# Defined with torch.library.define rather than custom_op (see dmuon::two_stage_reduce): both
# run under torch.func's grad transform, which rejects custom_op's autograd wrapper.
torch.library.define(
    "dmuon::owner_broadcast",
    "(Tensor local, int[] shape, int[] route, str group, str rep_group, float scale) -> Tensor",
    # never recomputed by graph partitioners (see the side-effect registration below)
    tags=(torch.Tag.nondeterministic_seeded,),
)
# A collective: never dead-code eliminated, even where this rank ignores the result (a
# non-owner's gradient slot), or the other ranks would wait for it forever.
torch.fx.node.has_side_effect(torch.ops.dmuon.owner_broadcast.default)


@torch.library.impl("dmuon::owner_broadcast", "CompositeExplicitAutograd")
def owner_broadcast(
    local: Tensor, shape: list[int], route: list[int], group: str, rep_group: str, scale: float
) -> Tensor:
    src, is_src, size = route[0], bool(route[1]), route[2]
    out = local.clone() if is_src else local.new_empty(shape)
    return broadcast_into(out, src, group, size)


@torch.library.register_fake("dmuon::owner_broadcast")
def _(local, shape, route, group, rep_group, scale):
    return local.new_empty(shape)


# No autograd registration here: its transpose is dmuon::two_stage_reduce, paired with it in
# dmuon_fn's `_OwnerBroadcast` autograd.Function, because torch.func's grad transform needs an
# autograd.Function with setup_context, which torch.library's registration does not provide in
# torch 2.13.


def _samples():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 4, generator=g)
    yield (x, [6, 4], [0, 1, 1, 0, 1, 1], "", "", 1.0), {}
    yield (torch.randn(3, generator=g), [3], [0, 1, 1, 0, 1, 1], "", "", 0.5), {}


register_op(OpSpec("dmuon::owner_broadcast", torch.ops.dmuon.owner_broadcast, _samples, False))
