"""dmuon::two_stage_reduce — sum a full-shape tensor onto its owner, in two stages under HSDP.

Stage 1 sums over `group` onto rank route[0]; on that rank (the local owner), stage 2 sums over
`rep_group` onto route[3] (the global owner) when route[5] > 1. The global owner gets
scale·Σ over all G·R ranks; every other rank gets zeros shaped like its local placeholder
(`local_shape`: full on local owners, 0-size elsewhere), so the result always has the shape of
the parameter slot it is a gradient for. route as in dmuon::owner_broadcast.

No autograd: it is owner_broadcast's backward; nothing differentiates through it twice.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._collectives import reduce_sum
from ._registry import OpSpec, register_op

# Defined with torch.library.define rather than custom_op: custom_op wraps every call in an
# autograd.Function without setup_context, which torch.func's grad transform rejects, and this op
# is called inside the backward of a function that torch.func differentiates.
torch.library.define(
    "dmuon::two_stage_reduce",
    "(Tensor full, int[] local_shape, int[] route, str group, str rep_group, float scale) "
    "-> Tensor",
    # never recomputed by graph partitioners (see the side-effect registration below)
    tags=(torch.Tag.nondeterministic_seeded,),
)
# A collective: never dead-code eliminated, even where this rank ignores the result (a
# non-owner's gradient slot), or the other ranks would wait for it forever.
torch.fx.node.has_side_effect(torch.ops.dmuon.two_stage_reduce.default)


@torch.library.impl("dmuon::two_stage_reduce", "CompositeExplicitAutograd")
def two_stage_reduce(
    full: Tensor,
    local_shape: list[int],
    route: list[int],
    group: str,
    rep_group: str,
    scale: float,
) -> Tensor:
    src, is_src, size, rep_src, is_rep_src, rep_size = route
    buf = reduce_sum(full.contiguous().clone(), src, group, size)
    if not is_src:
        return full.new_zeros(local_shape)
    if rep_size > 1:
        buf = reduce_sum(buf, rep_src, rep_group, rep_size)
        if not is_rep_src:
            return full.new_zeros(local_shape)
    return buf.mul_(scale)


@torch.library.register_fake("dmuon::two_stage_reduce")
def _(full, local_shape, route, group, rep_group, scale):
    return full.new_empty(local_shape)


def _samples():
    g = torch.Generator().manual_seed(4)
    yield (torch.randn(6, 4, generator=g), [6, 4], [0, 1, 1, 0, 1, 1], "", "", 0.25), {}
    yield (torch.randn(5, generator=g), [0], [0, 0, 1, 0, 0, 1], "", "", 1.0), {}


register_op(OpSpec("dmuon::two_stage_reduce", torch.ops.dmuon.two_stage_reduce, _samples, False))
