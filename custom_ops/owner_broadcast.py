"""dmuon::owner_broadcast(_start) — each parameter's full tensor, from its owner, on every rank.

locals[i]: the full tensor on parameter i's source rank, a 0-size placeholder elsewhere; shapes: the
full shapes flattened, ndims[i] entries for parameter i; routes: 6 ints per parameter, (src, is_src,
group_size, rep_src, is_rep_src, rep_size), src a rank of the process group named `group`, the last
three for dmuon::two_stage_reduce; `after` only orders the call. Returns the full tensors in order
(_start: a ticket for dmuon::collective_wait); no autograd (gradients: dmuon::two_stage_reduce)."""

from __future__ import annotations

import torch
from torch import Tensor

from ._collectives import Finish, broadcast_start, define_async, new_empty, per_param, wait_all


def _issue(locals, shapes, ndims, routes, group, after=None) -> Finish:
    bufs, works = [], []
    for local, shape, (src, is_src, size, *_) in per_param(locals, shapes, ndims, routes):
        bufs.append(local.clone() if is_src else local.new_empty(shape))
        works.append(broadcast_start(bufs[-1], src, group, size))

    def finish() -> list[Tensor]:
        wait_all(works)
        return bufs

    return finish


def _samples():
    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(6, 4, generator=g), torch.randn(3, generator=g)
    yield ([a, b], [6, 4, 3], [2, 1], [0, 1, 1, 0, 1, 1] * 2, ""), {}
    yield ([a], [6, 4], [2], [0, 1, 1, 0, 1, 1], ""), {"after": [b]}


define_async(
    "owner_broadcast",
    "Tensor[] locals, int[] shapes, int[] ndims, int[] routes, str group, Tensor[]? after=None",
    _issue,
    lambda locals, shapes, ndims, routes, group, after=None: new_empty(locals, shapes, ndims),
    _samples,
)
