"""The object API's hooks: per-module gather and reduce-to-owner, eager and in compiled blocks.

A pre-hook sets each dedicated parameter's full value as an instance attribute, a post-hook drops
it, backward deposits its gradient: eager through `_Gather`, compiled through the dmuon:: ops,
which see a slot's handle, shape, dtype and device only. Z3 re-gathers in backward (eager:
`_Z3Saver`; compiled: `torch.utils.checkpoint`). Rationale: proofs/dedicated_notes.md.
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
from ._schedule import Scheduler
from ._state import DedicatedState, Entry, Group, Unit, make_groups


class Slot:
    """One module attribute's use of one entry: gathered with `unit`, its gradient reduced into
    `bucket`; the custom_ops._handles Handler of its `handle`."""

    def __init__(self, e: Entry, unit: Unit, bucket: Group, st: DedicatedState) -> None:
        self.e, self.unit, self.bucket, self.st = e, unit, bucket, st
        self.handle = new_handle(self).requires_grad_(e.param.requires_grad)
        e.handles.append(self.handle)
        unit.handles.append(self.handle)

    def value(self) -> Tensor:
        """The entry's full value (`e.shape`, `e.dtype`); autograd sums its gradient back."""
        e = self.e
        if not torch.compiler.is_compiling():
            e.follow_requires_grad()
            owes = torch.is_grad_enabled() and self.handle.requires_grad
            return _Gather.apply(self.handle, self, owes)
        args = (self.handle, list(e.shape), e.dtype, e.device)
        if self.st.reshard_after_forward:  # recomputed in backward instead of saved
            return checkpoint(_gather_op, *args, use_reentrant=False)
        return _gather_op(*args)

    def start(self) -> None:  # dmuon::gather_start's runtime
        self.st.scheduler.open_unit(self.unit)

    def gather(self) -> Tensor:
        """dmuon::param_gather's runtime (in backward, a compiled Z3 block's re-gather)."""
        sched = self.st.scheduler
        if torch._C._current_graph_task_id() != -1:
            return sched.regather(self.unit).value(self.e)
        owes = self.handle.requires_grad
        if owes and self.st.reshard_after_forward:
            self.unit.owed_regathers += 1
        return sched.value(self.e, self.unit, self.bucket if owes else None)

    def reduce(self, grad: Tensor) -> None:
        if self.e.param.requires_grad:  # frozen since the last step: every rank skips alike
            self.st.scheduler.deposit(self.bucket, self.e, grad)


class _Gather(torch.autograd.Function):
    """Eager: the slot's value; backward deposits its gradient and gives the handle one."""

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


_HANDLE, _DTENSOR = object(), object()  # tags of what `_Z3Saver.pack` keeps


class _Z3Saver:
    """Eager Z3: saved-tensor hooks that keep (unit, group, view geometry) of gathered values and
    re-gather the unit when backward unpacks one; entered by a module's pre-hook, left by its
    post-hook."""

    def __init__(self, st: DedicatedState) -> None:
        self.st = st
        # storage ptr of a gathered group buffer -> (unit, group index, the buffer weakly: a ptr
        # is trusted only while its buffer lives)
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
        hit[0].owed_regathers += 1
        return (_HANDLE, hit[0], hit[1], t.size(), t.stride(), t.storage_offset())

    def unpack(self, x):
        if isinstance(x, tuple) and x and x[0] is _DTENSOR:
            _, inner, spec, requires_grad = x
            return fsdp.dtensor_wrap(self.unpack(inner), spec, requires_grad)
        if not (isinstance(x, tuple) and x and x[0] is _HANDLE):
            return x
        _, unit, i, size, stride, offset = x
        with torch.no_grad():
            flat = self.st.scheduler.regather(unit).flats[i]
        return flat.as_strided(size, stride, offset)


def install(
    model: nn.Module, st: DedicatedState, uses: dict[nn.Module, list[tuple[str, Entry]]], depth: int
) -> None:
    """Set `st.scheduler` and its hooks for `uses` (module -> its (attribute, entry) pairs): a
    unit per layer, a bucket per module and owner, a slot per (module, attribute)."""
    modules = dict(model.named_modules(remove_duplicate=False))
    names = {m: n for n, m in modules.items()}
    path = {m: f"{names[m]}.{pname}".lstrip(".") for m, s in uses.items() for pname, _ in s[:1]}
    keys = layer_keys(path.values())
    unit_key = {m: keys[path[m]] for m in uses}
    by_key: dict[str, list[Entry]] = {}  # an entry in several units is gathered for each
    for m, s in uses.items():
        by_key.setdefault(unit_key[m], []).extend(e for _, e in s)
    units = {key: Unit(key, make_groups(es)) for key, es in by_key.items()}
    buckets = {m: make_groups([e for _, e in s]) for m, s in uses.items()}
    st.scheduler = Scheduler(st, list(units.values()), sum(buckets.values(), ()), depth)
    for m, s in uses.items():
        of = {id(e): b for b in buckets[m] for e in b.entries}
        _module_hooks(m, [(n, Slot(e, units[unit_key[m]], of[id(e)], st)) for n, e in s], st)
    for key, unit in units.items():
        holder = modules.get(key)
        if holder is not None and holder not in uses:  # a block around the parameters' modules
            # issues its unit's gathers before its modules run (compiled: the first one's hook)
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


def _module_hooks(module: nn.Module, slots: list[tuple[str, Slot]], st: DedicatedState) -> None:
    """Gather `slots` ((attribute, slot) pairs of one unit) around every forward of `module`, as
    instance attributes shadowing the placeholders. Compiled, each module issues the whole
    unit's gathers (dmuon::gather_start over every slot handle of the unit)."""
    unit = slots[0][1].unit
    handles = unit.handles  # a plain list for the compiled hook to read
    saver = _Z3Saver(st) if st.reshard_after_forward else None

    def pre(mod: nn.Module, args):
        eager_z3 = saver is not None and not torch.compiler.is_compiling()
        if eager_z3:
            saver.leave()  # a no-op unless the last forward raised
        if torch.compiler.is_compiling():
            torch.ops.dmuon.gather_start(handles)
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
