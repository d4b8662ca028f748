"""dmuon::two_stage_reduce(_start) — sum full-shape gradients onto their owners, in two stages.

Per parameter (routes as in dmuon::owner_broadcast): stage 1 sums over `group` onto src, then on src
stage 2 over `rep_group` onto rep_src if rep_size > 1 (HSDP). The global owner gets scale·Σ, other
ranks zeros of their `local_shapes` slot (full on local owners, 0-size elsewhere). Copies the
gradients at issue; _start (with `after`) issues stage 1, collective_wait stage 2. No autograd."""

from __future__ import annotations

import torch
from torch import Tensor

from ._collectives import Finish, _group, define_async, new_empty, per_param, reduce_start

_ARGS = (
    "Tensor[] fulls, int[] local_shapes, int[] ndims, int[] routes, str group, str rep_group, "
    "float scale"
)


def _issue(fulls, local_shapes, ndims, routes, group, rep_group, scale, after=None) -> Finish:
    rows = []
    for full, shape, (src, is_src, size, *rep) in per_param(fulls, local_shapes, ndims, routes):
        buf = full.contiguous().clone()
        work = reduce_start(buf, src, _group(group)) if size > 1 else None
        rows.append((buf, work, shape, is_src, *rep))

    def finish() -> list[Tensor]:
        out = []
        for buf, work, shape, is_src, rep_src, is_rep_src, rep_size in rows:
            if work is not None:
                work.wait()
            if is_src and rep_size > 1:
                reduce_start(buf, rep_src, _group(rep_group)).wait()
            if is_src and (rep_size == 1 or is_rep_src):
                out.append(buf.mul_(scale))
            else:
                out.append(buf.new_zeros(shape))
        return out

    return finish


def _samples():
    g = torch.Generator().manual_seed(4)
    a, b = torch.randn(6, 4, generator=g), torch.randn(5, generator=g)
    yield ([a, b], [6, 4, 0], [2, 1], [0, 1, 1, 0, 1, 1, 0, 0, 1, 0, 0, 1], "", "", 0.25), {}


define_async(
    "two_stage_reduce",
    _ARGS,
    _issue,
    lambda fulls, local_shapes, ndims, *_: new_empty(fulls, local_shapes, ndims),
    _samples,
    start_args=_ARGS + ", Tensor[]? after=None",
)
