"""The object API's per-module gather and reduce-to-owner, eager and inside compiled blocks.

`install_hooks` gives every module that holds dedicated parameters a forward pre-hook, which
broadcasts each one's full value from its local owner and lets the module compute with it, and
a post-hook, which drops it. Backward sums the gradient of that value onto the owner (the
broadcast's transpose; a second stage across replicas under HSDP) and the global owner
accumulates the data-parallel mean into `param.grad`. `ParamHandler` runs both collectives for
one entry; two paths call it:

- eager: `_Gather`, an autograd.Function, calls it directly (so `CommCounter` sees c10d ops);
- compiled (`torch.compile` of a block that contains the module traces the hooks with it):
  dmuon::param_gather, whose autograd formula is dmuon::param_reduce. The ops take the entry's
  handle (custom_ops._handles), whose metadata is the same for every parameter on every rank,
  and the full shape and dtype; the hooks read nothing else of the entry (not `param`: full on
  owners, 0-size elsewhere). So a graph has no rank- or owner-specific constant or guard:
  identical blocks share one graph, and every rank traces the same graph, whose collectives
  any deterministic compiler then orders alike.

Z3 (`reshard_after_forward`): eager, saved_tensors_hooks swap autograd's saved references to a
gathered value for its entry and broadcast again when backward unpacks them; compiled, the
gather runs inside `torch.utils.checkpoint`, which under torch.compile tags it for recompute,
so the partitioner saves only the handle and gathers again in backward.

Which parameters took part in a step: backward gives the handle a gradient (`Entry.touched`).
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from custom_ops._collectives import broadcast_into, reduce_sum

from ._guard import phase

if TYPE_CHECKING:
    from ._dedicate import DedicatedState, Entry


class ParamHandler:
    """One entry's collectives (custom_ops._handles.Handler)."""

    def __init__(self, e: Entry, st: DedicatedState) -> None:
        self.e, self.st = e, st

    def gather(self) -> torch.Tensor:
        # a compiled Z3 block runs this op again in backward (inside the autograd engine)
        in_backward = torch._C._current_graph_task_id() != -1
        what = "backward (Z3 parameter re-gather)" if in_backward else "forward (parameter gather)"
        return broadcast_value(self.e, self.st, what)

    def reduce(self, grad: torch.Tensor) -> None:
        e, st = self.e, self.st
        if not e.param.requires_grad:  # frozen since the last step: every rank skips alike
            return
        g = grad.to(e.reduce_dtype).contiguous().clone()
        with phase(f"backward (gradient reduce of {e.name})"):
            reduce_sum(g, e.owner_shard, st.shard_group, st.shard_size)
            if st.replicate_group is not None and st.is_local_owner(e):
                reduce_sum(g, e.owner_replica, st.replicate_group, st.replicate_size)
        if st.is_global_owner(e):
            g = g.to(e.param.dtype).div_(st.shard_size * st.replicate_size)
            with torch.no_grad():  # what autograd's AccumulateGrad does
                if e.param.grad is None:
                    e.param.grad = g
                else:
                    e.param.grad += g


def broadcast_value(e: Entry, st: DedicatedState, what: str) -> torch.Tensor:
    """The full value in the gather dtype, broadcast from the local owner (after any pending
    HSDP publish into it has landed)."""
    with phase(f"{what} of {e.name}"):
        st.wait_publish(e)
        if st.is_local_owner(e):
            buf = e.param.detach().to(e.dtype, copy=True)
        else:
            buf = torch.empty(e.shape, dtype=e.dtype, device=e.param.device)
        return broadcast_into(buf, e.owner_shard, st.shard_group, st.shard_size)


class _Gather(torch.autograd.Function):
    """Eager: the handler's broadcast; backward its reduce, and a gradient for the handle."""

    @staticmethod
    def forward(ctx, handle: torch.Tensor, h: ParamHandler) -> torch.Tensor:
        ctx.h = h
        return h.gather()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.h.reduce(grad)
        return torch.ones(1, dtype=torch.float64, device="cpu"), None


def _gather_op(handle: torch.Tensor, shape: list[int], dtype: torch.dtype, device: torch.device):
    return torch.ops.dmuon.param_gather(handle, shape, dtype, device)


def gather(e: Entry, st: DedicatedState) -> torch.Tensor:
    """The full value of `e` for the module about to run; autograd sums its gradient back."""
    if not torch.compiler.is_compiling():
        e.follow_requires_grad()
        return _Gather.apply(e.handle, e.handler)
    shape = list(e.shape)
    if st.reshard_after_forward:  # recomputed in backward instead of saved
        return checkpoint(_gather_op, e.handle, shape, e.dtype, e.device, use_reentrant=False)
    return _gather_op(e.handle, shape, e.dtype, e.device)


class _Z3Saver:
    """Eager Z3: saved_tensors_hooks that keep only a handle to gathered values and gather
    again when backward needs them. Entered by a module's pre-hook, left by its post-hook."""

    def __init__(self, st: DedicatedState) -> None:
        self.st = st
        # storage ptr of a gathered value -> (its entry, the value, weakly: a ptr is trusted only
        # while the value lives, so an entry left behind by a forward that raised never matches)
        self.live: dict[int, tuple[Entry, weakref.ref]] = {}
        self.ctx: torch.autograd.graph.saved_tensors_hooks | None = None

    def enter(self) -> None:
        self.ctx = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
        self.ctx.__enter__()

    def leave(self) -> None:
        """Pop our hooks if they are on top (they are unless a forward raised in between)."""
        if self.ctx is not None:
            top = torch._C._autograd._top_saved_tensors_default_hooks(True)
            if top is not None and top[0] == self.pack:
                self.ctx.__exit__(None, None, None)
            self.ctx = None
        self.live.clear()

    def pack(self, t: torch.Tensor):
        hit = self.live.get(t.untyped_storage().data_ptr()) if t.device.type != "meta" else None
        if hit is None or hit[1]() is None:
            return t
        return (_HANDLE, hit[0], t.size(), t.stride(), t.storage_offset())

    def unpack(self, x):
        if not (isinstance(x, tuple) and x and x[0] is _HANDLE):
            return x
        _, e, size, stride, offset = x
        with torch.no_grad():
            full = broadcast_value(e, self.st, "backward (Z3 parameter re-gather)")
        return full.as_strided(size, stride, offset)


_HANDLE = object()


def install_hooks(module: nn.Module, slots: list[tuple[str, Entry]], st: DedicatedState) -> None:
    """Gather `slots` ((attribute name, entry) pairs) around every forward of `module`.

    The gathered value shadows the placeholder as an instance attribute (instance attributes
    come before `_parameters` in attribute lookup), so `parameters()` and state dicts never
    see it. The post-hook is not `always_call`: such hooks add a guard on their per-module
    hook id to every compiled graph, one graph per block. After a forward that raised, the
    next forward's pre-hook replaces the stale value and Z3's hooks.
    """
    saver = _Z3Saver(st) if st.reshard_after_forward else None

    def pre(mod: nn.Module, args):
        eager_z3 = saver is not None and not torch.compiler.is_compiling()
        if eager_z3:
            saver.leave()  # a no-op unless the last forward raised
        for pname, e in slots:
            full = gather(e, st)
            if eager_z3:
                saver.live[full.untyped_storage().data_ptr()] = (e, weakref.ref(full))
            object.__setattr__(mod, pname, full)
        if eager_z3 and torch.is_grad_enabled():
            saver.enter()

    def post(mod: nn.Module, args, output):
        if saver is not None and not torch.compiler.is_compiling():
            saver.leave()
        for pname, _ in slots:
            mod.__dict__.pop(pname)

    module.register_forward_pre_hook(pre)
    module.register_forward_hook(post)
