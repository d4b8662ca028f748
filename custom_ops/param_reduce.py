"""dmuon::param_reduce — sum a dedicated parameter's gradient onto its owner.

grad: the full-shape gradient of dmuon::param_gather's value for `handle`; the handler sums it onto
the owner (a collective on every rank of the group; dmuon_fn: into the global owner's `param.grad`).
Returns ones shaped like the handle, its gradient. No autograd: dmuon::param_gather's backward."""

from __future__ import annotations

import torch
from torch import Tensor

from . import _handles
from ._collectives import define_collective
from ._registry import OpSpec, register_op

define_collective("dmuon::param_reduce", "(Tensor grad, Tensor handle) -> Tensor")
torch.library.register_fake("dmuon::param_reduce")(lambda grad, handle: torch.empty_like(handle))


@torch.library.impl("dmuon::param_reduce", "CompositeExplicitAutograd")
def param_reduce(grad: Tensor, handle: Tensor) -> Tensor:
    _handles.handler(handle).reduce(grad)
    return torch.ones_like(handle)


def _samples():
    g = torch.Generator().manual_seed(6)
    for h in _handles.sample_handlers():
        yield (torch.randn(h.value.shape, generator=g).to(h.value.dtype), h.handle), {}


register_op(OpSpec("dmuon::param_reduce", torch.ops.dmuon.param_reduce, _samples, False))
