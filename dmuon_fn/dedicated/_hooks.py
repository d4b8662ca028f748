"""The module hooks of dedicated parameters: each module's forward takes its attributes' full
values from the scheduler (a sliced parameter's pieces concatenated), backward deposits their
gradients; eager Z3 re-gathers what backward unpacks (proofs/dedicate.md, proofs/prefetch.md)."""

from __future__ import annotations

import contextlib
import weakref

import torch
import torch.nn as nn
from torch import Tensor
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack, _pop_mode_temporarily
from torch.utils.checkpoint import (
    _CachedTorchDispatchMode,
    _CachingTorchDispatchMode,
    checkpoint,
)

from custom_ops._handles import new_handle

from ..planning._layers import layer_keys
from ..planning._slices import join
from . import _fsdp_adapter as fsdp
from ._schedule import Scheduler
from ._state import DedicatedState, Entry, Group, Unit, make_groups


class Slot:
    """One module attribute's use of an entry; the custom_ops._handles Handler of `handle`."""

    def __init__(self, e: Entry, unit: Unit, bucket: Group, st: DedicatedState) -> None:
        self.e, self.unit, self.bucket, self.st = e, unit, bucket, st
        self.handle = new_handle(self).requires_grad_(e.param.requires_grad)
        e.handles.append(self.handle)
        unit.handles.append(self.handle)

    def value(self) -> Tensor:
        """Eager: the entry's full value (`e.shape`, `e.dtype`); autograd sums its gradient back
        (compiled: `_value`)."""
        self.e.follow_requires_grad()
        owes = torch.is_grad_enabled() and self.handle.requires_grad
        return _Gather.apply(self.handle, self, owes)

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


def _cat(values: list[Tensor], es: list[Entry] | tuple[Entry, ...]) -> Tensor:
    """A parameter from its pieces' values (entries `es`, `join`ed)."""
    return values[0] if len(values) == 1 else join([e.name for e in es], values)


def _value(group: list[Slot]) -> Tensor:
    """A parameter's full value from its slots (a sliced one's pieces concatenated); compiled,
    dmuon::param_gather per slot, which Z3 recomputes in backward (with the concatenation)
    instead of saving."""
    es = [slot.e for slot in group]
    if not torch.compiler.is_compiling():
        return _cat([slot.value() for slot in group], es)

    def gather(*hs: Tensor) -> Tensor:
        op = torch.ops.dmuon.param_gather
        values = [op(h, list(e.shape), e.dtype, e.device) for h, e in zip(hs, es, strict=True)]
        return _cat(values, es)

    handles = [slot.handle for slot in group]
    if group[0].st.reshard_after_forward:
        return checkpoint(gather, *handles, use_reentrant=False)
    return gather(*handles)


class _Z3Saver:
    """Eager Z3: saved-tensor hooks that keep (unit, group, view geometry) of gathered values and
    re-gather the unit when backward unpacks one."""

    def __init__(self, st: DedicatedState) -> None:
        self.st = st
        # storage ptr of a gathered buffer -> (unit, group index, the buffer: the ptr's witness)
        self.live: dict[int, tuple[Unit, int, weakref.ref]] = {}
        self.ctx: torch.autograd.graph.saved_tensors_hooks | None = None

    def enter(self, unit: Unit, cats: list[tuple[Tensor, tuple[Entry, ...]]]) -> None:
        """Track `unit`'s gathered buffers and `cats`, its sliced parameters' concatenated values
        (with their pieces, to concatenate again)."""
        for i, flat in enumerate(self.st.scheduler.open_unit(unit).flats):
            self.live[flat.untyped_storage().data_ptr()] = (unit, i, weakref.ref(flat))
        for value, pieces in cats:
            self.live[value.untyped_storage().data_ptr()] = (unit, pieces, weakref.ref(value))
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
        if (parts := fsdp.dtensor_unwrap(t)) is not None:  # a tensor-parallel part, as computed
            inner = self.pack(parts[0])
            return t if inner is parts[0] else (inner, parts[1], t.requires_grad)
        # another subclass has no storage of its own to look up and is never one of ours
        if t.device.type == "meta" or type(t) not in (Tensor, nn.Parameter):
            return t
        hit = self.live.get(t.untyped_storage().data_ptr())
        if hit is None or hit[2]() is None:
            return t
        hit[0].owed_regathers += 1
        return (hit[0], hit[1], t.size(), t.stride(), t.storage_offset())

    def unpack(self, x):
        """`pack`'s inverse (DTensor: (inner, spec, requires_grad))."""
        if isinstance(x, Tensor):
            return x
        if len(x) == 3:
            inner, spec, requires_grad = x
            return fsdp.dtensor_wrap(self.unpack(inner), spec, requires_grad)
        unit, i, size, stride, offset = x
        with torch.no_grad():
            flight = self.st.scheduler.regather(unit)
            base = flight.flats[i] if isinstance(i, int) else _cat([flight.value(e) for e in i], i)
        return base.as_strided(size, stride, offset)


def install(
    model: nn.Module,
    st: DedicatedState,
    uses: dict[nn.Module, list[tuple[str, list[Entry]]]],
    depth: int,
) -> None:
    """Set `st.scheduler` and its hooks for `uses` (module -> its (attribute, entries) pairs, the
    entries a parameter's pieces): a unit per layer, a bucket per module and owner, a slot per
    (module, attribute, entry)."""
    modules = dict(model.named_modules(remove_duplicate=False))
    path = {m: f"{n}.{uses[m][0][0]}".lstrip(".") for n, m in modules.items() if m in uses}
    keys = layer_keys(path.values())
    unit_key = {m: keys[p] for m, p in path.items()}
    by_key: dict[str, list[Entry]] = {}  # an entry in several units is gathered for each
    for m, s in uses.items():
        by_key.setdefault(unit_key[m], []).extend(e for _, es in s for e in es)
    units = {key: Unit(key, make_groups(es)) for key, es in by_key.items()}
    buckets = {m: make_groups([e for _, es in s for e in es]) for m, s in uses.items()}
    st.scheduler = Scheduler(st, list(units.values()), sum(buckets.values(), ()), depth)
    for m, s in uses.items():
        of = {id(e): b for b in buckets[m] for e in b.entries}
        unit = units[unit_key[m]]
        _module_hooks(m, [(n, [Slot(e, unit, of[id(e)], st) for e in es]) for n, es in s], st)
    for key, unit in units.items():  # a block around the modules issues its unit's gathers first
        if (holder := modules.get(key)) is not None and holder not in uses:
            holder.register_forward_pre_hook(_eager(lambda u=unit: st.scheduler.open_unit(u)))
    # (a compiled root: no recorded order, every gather issued when needed)
    model.register_forward_pre_hook(_eager(lambda: st.scheduler.begin_forward()))
    model.register_forward_hook(_eager(lambda: st.scheduler.end_forward()))


# selective activation checkpointing's modes: the forward records ops, the recompute replays them
_SAC_MODES = (_CachingTorchDispatchMode, _CachedTorchDispatchMode)


@contextlib.contextmanager
def _outside_sac():
    """Selective activation checkpointing's dispatch modes off while a hook runs: what a hook
    issues (gathers, waits, the attributes' values) follows the scheduler's state (what is
    already prefetched), not the block's inputs, so a recompute would not replay the forward's
    ops (SAC raises); their values enter the block as its inputs do."""
    with contextlib.ExitStack() as stack:
        while (modes := _get_current_dispatch_mode_stack()) and isinstance(modes[-1], _SAC_MODES):
            stack.enter_context(_pop_mode_temporarily())
        yield


def _eager(fn):
    """A module hook that calls `fn()`, except while torch.compile traces."""

    def hook(mod: nn.Module, *args):
        if not torch.compiler.is_compiling():
            with _outside_sac():
                fn()

    return hook


def _module_hooks(
    module: nn.Module, slots: list[tuple[str, list[Slot]]], st: DedicatedState
) -> None:
    """Set each attribute's value (its slots' (of one unit), pieces joined along their dim) as
    instance attributes around every forward of `module`; compiled, each module issues the whole
    unit's gathers (dmuon::gather_start)."""
    unit = slots[0][1][0].unit
    handles = unit.handles  # a plain list for the compiled hook to read
    saver = _Z3Saver(st) if st.reshard_after_forward else None

    def pre(mod: nn.Module, args):
        eager_z3 = saver is not None and not torch.compiler.is_compiling()
        if eager_z3:
            saver.leave()  # a no-op unless the last forward raised
        if torch.compiler.is_compiling():
            torch.ops.dmuon.gather_start(handles)
        cats = []  # (value, its pieces) of the sliced parameters
        for pname, group in slots:
            value = _value(group)
            if len(group) > 1:
                cats.append((value, tuple(slot.e for slot in group)))
            if group[0].e.tp is not None:  # this tensor rank's part, as the DTensor the module had
                value = group[0].e.tp.to_module(value)
            object.__setattr__(mod, pname, value)
        if eager_z3 and torch.is_grad_enabled():
            saver.enter(unit, cats)

    def post(mod: nn.Module, args, output):
        if saver is not None and not torch.compiler.is_compiling():
            saver.leave()
        for pname, _ in slots:
            mod.__dict__.pop(pname)

    module.register_forward_pre_hook(_outside_sac_hook(pre))
    module.register_forward_hook(_outside_sac_hook(post))


def _outside_sac_hook(hook):
    """`hook`, run outside selective activation checkpointing's modes (eager; compiled, the
    graph's own)."""

    def run(*args):
        if torch.compiler.is_compiling():
            return hook(*args)
        with _outside_sac():
            return hook(*args)

    return run
