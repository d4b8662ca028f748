"""The object API's hooks: per-module gather and reduce-to-owner, eager and in compiled blocks.

A module that holds dedicated parameters gets a forward pre-hook, which sets each one's full
value (its unit's gathers, from the scheduler) as an instance attribute, and a post-hook, which
drops it; backward hands the value's gradient to the scheduler. A `Slot` (one module
attribute's use of one entry) serves both paths: eager, the autograd.Function `_Gather`;
compiled, dmuon::param_gather (backward: dmuon::param_reduce) and dmuon::gather_start at a
block's entry, which take the slot's handle (custom_ops._handles), shape, dtype and device,
nothing rank- or owner-specific (proofs/dedicated_notes.md). Z3 (`reshard_after_forward`):
eager, saved_tensors_hooks re-gather when backward unpacks a gathered value (`_Z3Saver`);
compiled, the gather runs inside `torch.utils.checkpoint`, recomputed in backward.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn as nn
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from custom_ops._handles import new_handle

from ..planning._partition import layer_keys
from . import _fsdp_adapter as fsdp
from ._entries import Entry
from ._schedule import Scheduler
from ._state import DedicatedState
from ._units import Group, Unit, make_groups, make_units


class Slot:
    """One module attribute's use of one entry: gathered with its unit, its gradient reduced
    with its module's bucket (a custom_ops._handles Handler); backward gives its handle a
    gradient (`Entry.touched`)."""

    def __init__(self, e: Entry, unit: Unit, bucket: Group, st: DedicatedState) -> None:
        self.e, self.unit, self.bucket, self.st = e, unit, bucket, st
        self.handle = new_handle(self).requires_grad_(e.param.requires_grad)
        e.handles.append(self.handle)

    def value(self) -> Tensor:
        """The entry's full value (`e.shape`, `e.dtype`) for the module about to run; autograd
        sums its gradient back."""
        e = self.e
        if not torch.compiler.is_compiling():
            e.follow_requires_grad()
            owes = torch.is_grad_enabled() and self.handle.requires_grad
            return _Gather.apply(self.handle, self, owes)
        shape = list(e.shape)
        if self.st.reshard_after_forward:  # recomputed in backward instead of saved
            return checkpoint(
                _gather_op, self.handle, shape, e.dtype, e.device, use_reentrant=False
            )
        return _gather_op(self.handle, shape, e.dtype, e.device)

    def start(self) -> None:
        """dmuon::gather_start's runtime: the unit's gathers are issued (if not already)."""
        self.st.scheduler.open_unit(self.unit)

    def gather(self) -> Tensor:
        """dmuon::param_gather's runtime; run again in backward by a compiled Z3 block (inside
        the autograd engine), it takes the unit's re-gathered copy."""
        sched = self.st.scheduler
        if torch._C._current_graph_task_id() != -1:
            value = sched.regather(self.unit).value(self.e)
            sched.release(self.unit)
            return value
        owes = self.handle.requires_grad
        if owes and self.st.reshard_after_forward:
            self.unit.owed_regathers += 1
        return sched.value(self.e, self.unit, self.bucket if owes else None)

    def reduce(self, grad: Tensor) -> None:
        if self.e.param.requires_grad:  # frozen since the last step: every rank skips alike
            self.st.scheduler.deposit(self.bucket, self.e, grad)


class _Gather(torch.autograd.Function):
    """Eager: the slot's value; backward its deposit, and a gradient for the handle."""

    @staticmethod
    def forward(ctx, handle: Tensor, slot: Slot, owes_grad: bool) -> Tensor:
        ctx.slot = slot
        return slot.st.scheduler.value(slot.e, slot.unit, slot.bucket if owes_grad else None)

    @staticmethod
    def backward(ctx, grad: Tensor):
        ctx.slot.reduce(grad)
        return torch.ones(1, dtype=torch.float64, device="cpu"), None, None


def _gather_op(handle: Tensor, shape: list[int], dtype: torch.dtype, device: torch.device):
    return torch.ops.dmuon.param_gather(handle, shape, dtype, device)


class _Z3Saver:
    """Eager Z3: saved_tensors_hooks that keep only (unit, group, view geometry) of gathered
    values and re-gather the unit when backward needs them. Entered by a module's pre-hook,
    left by its post-hook."""

    def __init__(self, st: DedicatedState) -> None:
        self.st = st
        # storage ptr of a gathered group buffer -> (unit, group index, the buffer, weakly: a
        # ptr is trusted only while the buffer lives, so one left behind never matches)
        self.live: dict[int, tuple[Unit, int, weakref.ref]] = {}
        self.ctx: torch.autograd.graph.saved_tensors_hooks | None = None

    def enter(self, unit: Unit) -> None:
        for i, flat in enumerate(self.st.scheduler.open_unit(unit).flats):
            self.live[flat.untyped_storage().data_ptr()] = (unit, i, weakref.ref(flat))
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

    def pack(self, t: Tensor):
        parts = fsdp.dtensor_unwrap(t)
        if parts is not None:  # a tensor-parallel part, as the module computes with it
            inner = self.pack(parts[0])
            return t if inner is parts[0] else (_DTENSOR, inner, parts[1], t.requires_grad)
        # another subclass has no storage of its own to look up and is never one of ours
        if t.device.type == "meta" or type(t) not in (Tensor, nn.Parameter):
            return t
        hit = self.live.get(t.untyped_storage().data_ptr())
        if hit is None or hit[2]() is None:
            return t
        unit, i = hit[0], hit[1]
        unit.owed_regathers += 1
        return (_HANDLE, unit, i, t.size(), t.stride(), t.storage_offset())

    def unpack(self, x):
        if isinstance(x, tuple) and x and x[0] is _DTENSOR:
            _, inner, spec, requires_grad = x
            return fsdp.dtensor_wrap(self.unpack(inner), spec, requires_grad)
        if not (isinstance(x, tuple) and x and x[0] is _HANDLE):
            return x
        _, unit, i, size, stride, offset = x
        sched = self.st.scheduler
        with torch.no_grad():
            flat = sched.regather(unit).flats[i]
        sched.release(unit)
        return flat.as_strided(size, stride, offset)


_HANDLE = object()
_DTENSOR = object()


def install(
    model: nn.Module, st: DedicatedState, uses: dict[nn.Module, list[tuple[str, Entry]]], depth: int
) -> None:
    """`st.scheduler` and the hooks that run it, for `uses` (module -> its (attribute, entry)
    pairs). Units: one per layer, keyed as the planner keys layers (else per module); buckets:
    per module and owner; one slot per (module, attribute)."""
    names = {m: n for n, m in model.named_modules(remove_duplicate=False)}
    path = {m: f"{names[m]}.{pname}".lstrip(".") for m, s in uses.items() for pname, _ in s[:1]}
    keys = layer_keys(path.values())
    unit_key = {m: keys[path[m]] for m in uses}
    units = {
        u.key: u for u in make_units([(unit_key[m], e) for m, s in uses.items() for _, e in s])
    }
    buckets = {m: make_groups([e for _, e in s]) for m, s in uses.items()}
    bucket_of = {(m, id(e)): b for m, bs in buckets.items() for b in bs for e in b.entries}
    all_buckets = [b for bs in buckets.values() for b in bs]
    st.scheduler = Scheduler(st, list(units.values()), all_buckets, depth)
    slots = {
        m: [(n, Slot(e, units[unit_key[m]], bucket_of[m, id(e)], st)) for n, e in s]
        for m, s in uses.items()
    }
    handles: dict[str, list[Tensor]] = {}
    for m, ss in slots.items():
        handles.setdefault(unit_key[m], []).extend(slot.handle for _, slot in ss)
    for m, ss in slots.items():
        _module_hooks(m, ss, units[unit_key[m]], handles[unit_key[m]], st)
    modules = dict(model.named_modules(remove_duplicate=False))
    for key, unit in units.items():
        holder = modules.get(key)
        if holder is not None and holder not in uses:  # a block around the parameters' modules
            # its unit's gathers issued before the modules inside run (compiled blocks issue
            # them from the first parameter module's hook, inside the block's graph)
            holder.register_forward_pre_hook(_eager(lambda u=unit: st.scheduler.open_unit(u)))
    # the model's forward begins and ends a recorded order (a compiled root leaves the
    # scheduler off its recorded order: every gather then issued when needed)
    model.register_forward_pre_hook(_eager(lambda: st.scheduler.begin_forward()))
    model.register_forward_hook(_eager(lambda: st.scheduler.end_forward()))


def _eager(fn):
    """A module hook that calls `fn()`, except while torch.compile traces."""

    def hook(mod: nn.Module, *args):
        if not torch.compiler.is_compiling():
            fn()

    return hook


def _module_hooks(
    module: nn.Module,
    slots: list[tuple[str, Slot]],
    unit: Unit,
    unit_handles: list[Tensor],
    st: DedicatedState,
) -> None:
    """Gather `slots` ((attribute name, slot) pairs, all of `unit`) around every forward of
    `module`, as instance attributes shadowing the placeholders (`parameters()` and state dicts
    never see them). Compiled, the first module of a block issues the whole unit's gathers
    (dmuon::gather_start over `unit_handles`, every slot handle of the unit). After a forward
    that raised, the next pre-hook replaces the stale values and Z3's hooks."""
    saver = _Z3Saver(st) if st.reshard_after_forward else None

    def pre(mod: nn.Module, args):
        eager_z3 = saver is not None and not torch.compiler.is_compiling()
        if eager_z3:
            saver.leave()  # a no-op unless the last forward raised
        if torch.compiler.is_compiling():
            torch.ops.dmuon.gather_start(unit_handles)
        for pname, slot in slots:
            value = slot.value()
            if slot.e.tp is not None:  # this tensor rank's part, as the DTensor the module had
                value = slot.e.tp.to_module(value)
            object.__setattr__(mod, pname, value)
        if eager_z3 and torch.is_grad_enabled():
            saver.enter(unit)

    def post(mod: nn.Module, args, output):
        if saver is not None and not torch.compiler.is_compiling():
            saver.leave()
        for pname, _ in slots:
            mod.__dict__.pop(pname)

    module.register_forward_pre_hook(pre)
    module.register_forward_hook(post)
