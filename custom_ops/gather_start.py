"""dmuon::gather_start — issue the gathers of a block's dedicated parameters before it computes.

handles: one unit's (custom_ops._handles). The handler issues the unit's gathers (collectives on
every rank of the group, in one order) unless on their way, and returns; dmuon::param_gather waits
for each value. No outputs or autograd; side-effectful, never eliminated."""

from __future__ import annotations

import torch
from torch import Tensor

from . import _handles
from ._collectives import define_collective
from ._registry import OpSpec, register_op

define_collective("dmuon::gather_start", "(Tensor[] handles) -> ()", seeded=False)
torch.library.register_fake("dmuon::gather_start")(lambda handles: None)


@torch.library.impl("dmuon::gather_start", "CompositeExplicitAutograd")
def gather_start(handles: list[Tensor]) -> None:
    if handles:
        _handles.handler(handles[0]).start()


def _samples():
    yield ([h.handle for h in _handles.sample_handlers()],), {}


register_op(OpSpec("dmuon::gather_start", torch.ops.dmuon.gather_start, _samples, False))
