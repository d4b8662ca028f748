"""dmuon::gather_start — issue the gathers of a block's dedicated parameters before it computes.

handles: the handles (custom_ops._handles) of the parameters of one unit (a block). The handler
issues the unit's gathers (collectives on every rank of the group, in the same order) if they
are not on their way yet, and returns at once; each parameter's dmuon::param_gather waits for
its value later. A compiled block begins its graph with this op.

No outputs and no autograd: nothing flows out of it. Side-effectful, never eliminated.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import _handles
from ._registry import OpSpec, register_op

torch.library.define("dmuon::gather_start", "(Tensor[] handles) -> ()")
torch.fx.node.has_side_effect(torch.ops.dmuon.gather_start.default)


@torch.library.impl("dmuon::gather_start", "CompositeExplicitAutograd")
def gather_start(handles: list[Tensor]) -> None:
    if handles:
        _handles.handler(handles[0]).start()


@torch.library.register_fake("dmuon::gather_start")
def _(handles):
    return None


def _samples():
    yield ([h.handle for h in _handles.sample_handlers()],), {}


register_op(OpSpec("dmuon::gather_start", torch.ops.dmuon.gather_start, _samples, False))
