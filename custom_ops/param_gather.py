"""dmuon::param_gather — a dedicated parameter's full value, from its owner, on this rank.

handle: names the parameter (custom_ops._handles); shape, dtype, device: the full value's, the
same on every rank. The handler runs the broadcast from the owner (a collective on every rank of
the group). Autograd: the gradient goes to dmuon::param_reduce, whose result is the handle's
gradient. Side-effectful, not tagged seeded: Z3 recomputes it (proofs/custom_ops_notes.md)."""

from __future__ import annotations

import torch
from torch import Tensor

from . import _handles
from ._collectives import define_collective
from ._registry import OpSpec, register_op

define_collective(
    "dmuon::param_gather",
    "(Tensor handle, int[] shape, ScalarType dtype, Device device) -> Tensor",
    seeded=False,
)


@torch.library.impl("dmuon::param_gather", "CompositeExplicitAutograd")
def param_gather(
    handle: Tensor, shape: list[int], dtype: torch.dtype, device: torch.device
) -> Tensor:
    out = _handles.handler(handle).gather()
    if out.shape != tuple(shape) or out.dtype != dtype or out.device != torch.device(device):
        raise RuntimeError(
            f"dmuon::param_gather: the handler returned {tuple(out.shape)} {out.dtype} on "
            f"{out.device}, the op promised {tuple(shape)} {dtype} on {device}"
        )
    return out


@torch.library.register_fake("dmuon::param_gather")
def _(handle, shape, dtype, device):
    return torch.empty(shape, dtype=dtype, device=device)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _backward(ctx, grad):
    (handle,) = ctx.saved_tensors
    return torch.ops.dmuon.param_reduce(grad, handle), None, None, None


torch.library.register_autograd("dmuon::param_gather", _backward, setup_context=_setup_context)


def _samples():
    handlers = _handles.sample_handlers()
    for h in handlers:
        v = h.value
        yield (h.handle.detach().requires_grad_(), list(v.shape), v.dtype, v.device), {}
    yield (handlers[0].handle, [6, 4], torch.float32, torch.device("cpu")), {}  # no autograd


register_op(OpSpec("dmuon::param_gather", torch.ops.dmuon.param_gather, _samples, True))
