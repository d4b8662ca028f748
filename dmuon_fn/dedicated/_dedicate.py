"""dedicate_params: one owner rank per parameter, its full value gathered around each module's
forward and its gradient reduced to the owner (proofs/dedicate.md, proofs/dedicated_notes.md)."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping

import torch
import torch.nn as nn
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.checkpoint import checkpoint

from custom_ops._collectives import broadcast_into
from custom_ops._handles import new_handle

from ..comm._mesh import check_dtypes, check_meshes, master_dtype, own_group, phase
from ..ns._blocks import Blocks, block_shapes, model_blocks
from ..ns._dispatch import agreed_aspect
from ..planning._check import check_plan_consistent
from ..planning._partition import RankView, layer_keys, partition
from ..planning._summary import PlanSummary
from ..planning._summary import plan_summary as _summarize
from ..planning._tensor import LOCAL
from ..tp._layout import TensorMesh, check_crossing, find_tensor_mesh, layout_name, make_layout
from . import _fsdp_adapter as fsdp
from ._schedule import Scheduler
from ._state import STATE_ATTR, DedicatedState, Entry, Group, Unit, dedicated_state, make_groups


def dedicate_params(
    model: nn.Module,
    mesh: DeviceMesh,
    predicate: Callable[[str, nn.Parameter], bool] | None = None,
    *,
    replicate_mesh: DeviceMesh | None = None,
    reshard_after_forward: bool = True,
    pure: bool = False,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    prefetch: int = 1,
    blocks: Mapping[str, Blocks | str] | None = None,
) -> dict[str, int | tuple[int, int]]:
    """Give each parameter matched by `predicate(name, param)` one owner; call before fully_shard.

    mesh: the 1-D shard mesh (HSDP: `hsdp["shard"]`, with `replicate_mesh=hsdp["replicate"]`;
        tensor parallelism: `parallelize_module` over the 'tp' dim first, then the data dim of
        the same mesh, ('dp', 'tp') or ('replicate', 'shard', 'tp'); proofs/tensor_parallel.md).
    reshard_after_forward: True, Z3 (gathered again in backward); False, Z2 (the copies kept).
    pure: dedicate every parameter (predicate ignored): Muon on matrices and AdamW on the rest
        by their owners; no FSDP2 needed.
    param_dtype: the gather and compute dtype (default: the parameter's); the global owner keeps
        the master in the parameter's dtype, at least fp32. reduce_dtype: the gradient sums'
        (default: param_dtype's).
    prefetch: layers whose gathers travel ahead of the one computing (the last forward's order;
        Z3 backward: reversed); 0: every gather and reduce blocks. Z3 holds up to prefetch + 1
        layers' gathered copies.
    blocks: {name or fnmatch pattern: `Blocks` spec} for matrices made of several (experts,
        fused qkv, heads; ns/_blocks.py); default: conv weights one flattened matrix, other 3+-D
        parameters a batch of matrices over their leading dims.
    Returns {name: owner}: the shard rank, or (shard, replica) under HSDP (tensor parallelism:
    the data coordinate; `plan.tensor_slot(name)` its root tensor rank).
    """
    if dedicated_state(model) is not None:
        raise ValueError("dedicate_params was already applied to this model")
    if fsdp.fsdp_modules(model):
        raise ValueError(
            "dedicate_params must run before fully_shard: FSDP2 already manages parameters of "
            "this model. Call dedicate_params(model, ...) first, then fully_shard"
        )
    if predicate is None and not pure:
        raise ValueError("pass a predicate(name, param) -> bool, or pure=True to dedicate all")
    tmesh = find_tensor_mesh(model)
    check_meshes(mesh, replicate_mesh, tensor_size=1 if tmesh is None else tmesh.size())
    if tmesh is not None:
        check_crossing(tmesh, [m for m in (mesh, replicate_mesh) if m is not None])
    check_dtypes(param_dtype, reduce_dtype)

    params: dict[int, tuple[nn.Parameter, list[str]]] = {}  # id -> (parameter, its names)
    for name, p in model.named_parameters(remove_duplicate=False):
        if pure or predicate(name, p):
            if not pure and p.ndim < 2:
                raise ValueError(
                    f"{name} (shape {tuple(p.shape)}) matched the predicate but is not a "
                    "matrix: Muon orthogonalizes matrices. Exclude it from the predicate (FSDP2 "
                    "shards it and Muon applies AdamW), or pass pure=True to dedicate every "
                    "parameter with AdamW on the owners of non-matrices"
                )
            params.setdefault(id(p), (p, []))[1].append(name)
    if not params:
        raise ValueError(
            "predicate matched no parameter: e.g. predicate=lambda n, p: 'proj' in n and "
            "p.ndim == 2 dedicates the projection matrices"
        )

    R = 1 if replicate_mesh is None else replicate_mesh.size()
    shapes = {names[0]: tuple(p.shape) for p, names in params.values()}
    device = _mesh_device(mesh, next(iter(params.values()))[0].device)
    plan = partition(
        shapes,
        mesh.size() * R,
        replicate_size=R,
        elementwise=[n for n, shape in shapes.items() if len(shape) < 2],
        gram_min_aspect=agreed_aspect(device),  # every rank plans (and runs) rank 0's dispatch
        tensor_size=1 if tmesh is None else tmesh.size(),
        layouts=None if tmesh is None else {n[0]: layout_name(p) for p, n in params.values()},
        blocks=model_blocks(model, [n for n, s in shapes.items() if len(s) >= 2], blocks),
    )
    split = [n for n, s in shapes.items() if len(s) >= 2 and _blocks(plan.blocks_of(n), s) > 1]
    split = [n for n in split if plan.tensor_slot(n) != LOCAL]  # (whole experts per rank: fine)
    if tmesh is not None and split:
        raise ValueError(
            f"{split[0]} is made of several matrices ({plan.blocks_of(split[0])}), which tensor "
            "parallelism splits only as Shard over a batch dim (whole experts on each rank, "
            f"expert parallelism): pass blocks={{{split[0]!r}: 'flatten'}} to orthogonalize it "
            "as one matrix, or leave it out of tensor parallelism"
        )
    check_plan_consistent(plan)  # before any other collective: ranks that disagree all raise
    tp = None
    if tmesh is not None:
        tp = TensorMesh(tmesh, own_group(tmesh.get_group()), tmesh.get_local_rank(), tmesh.size())
    groups = [None if m is None else own_group(m.get_group()) for m in (mesh, replicate_mesh)]
    replica = 0 if replicate_mesh is None else replicate_mesh.get_local_rank()
    view = RankView(plan, mesh.get_local_rank(), replica)
    st = DedicatedState(view, *groups, reshard_after_forward, tp)
    of_old: dict[int, Entry] = {}  # id(the parameter replaced) -> its entry
    for pid, (p, names) in params.items():
        old = fsdp.local(p)  # (tensor parallelism: this tensor rank's part)
        dt, device = param_dtype or old.dtype, _mesh_device(mesh, old.device)
        owner = st.view.coords(names[0])
        e = Entry(names[0], tuple(names), old.shape, dt, reduce_dtype or dt, *owner, old, device)
        if tp is not None:
            e.tp = make_layout(p, tp, plan.tensor_slot(names[0]))
        if st.is_global_owner(e):
            data = old.detach().to(e.device, master_dtype(old.dtype), copy=True)
        elif st.is_local_owner(e):
            data = old.detach().to(e.device, dt, copy=True)
        else:
            data = torch.empty(0, dtype=dt, device=e.device)
        e.param = nn.Parameter(data, requires_grad=old.requires_grad)
        setattr(e.param, fsdp.DEDICATED_ATTR, True)
        of_old[pid] = e
        st.entries.append(e)
        st.by_param[id(e.param)] = e

    uses: dict[nn.Module, list[tuple[str, Entry]]] = {}  # module -> its (attribute, entry)s
    for module in model.modules():
        for pname, p in list(module._parameters.items()):
            if p is not None and (e := of_old.get(id(p))) is not None:
                module._parameters[pname] = e.param
                uses.setdefault(module, []).append((pname, e))
    install(model, st, uses, prefetch)
    # equal copies: TP's whole copies take tensor rank 0's value, HSDP's the global owner's (cast)
    mine, rep = [e for e in st.entries if st.is_local_owner(e)], st.replicate_group
    for e in mine:
        if tp is not None and not e.tp.sharded:
            with phase(f"dedicate_params (tensor-parallel sync of {e.name})"):
                broadcast_into(e.param.detach(), 0, tp.group, tp.size)
    for e in mine if rep is not None else ():
        with phase(f"dedicate_params (replica sync of {e.name})"):
            broadcast_into(e.param.detach().to(e.dtype), e.owner_replica, rep, R)
    setattr(model, STATE_ATTR, st)
    return {n: plan.owner(e.name) for e in st.entries for n in e.names}


def _blocks(spec: Blocks | None, shape: tuple[int, ...]) -> int:
    return 0 if spec is None else sum(k for k, _ in block_shapes(spec, shape))


def _mesh_device(mesh: DeviceMesh, current: torch.device) -> torch.device:
    """`current`, or the mesh's device type where they differ (CUDA: the current device)."""
    if mesh.device_type == "cuda" and current.type != "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return current if current.type == mesh.device_type else torch.device(mesh.device_type)


def wait_gradients(model: nn.Module) -> None:
    """Block until backward's dedicated gradient reduces have landed in the global owners'
    `.grad`. Muon's `step`, `clip_grad_norm_`, `zero_grad`, the checkpoints and the next forward
    wait by themselves; call this before other code reads or zeroes those `.grad`s."""
    dedicated_state(model, required=True).scheduler.wait_reduces()


def set_requires_gradient_sync(model: nn.Module, requires_gradient_sync: bool) -> None:
    """False: backward sums each dedicated gradient on every rank (a full-shape buffer each) and
    reduces nothing; True (default): the next backward reduces those sums with its own. Sets
    FSDP2's switch on every `fully_shard`ed module too."""
    dedicated_state(model, required=True).scheduler.sync = bool(requires_gradient_sync)
    fsdp.set_requires_gradient_sync(model, requires_gradient_sync)


def plan_summary(source: object, *, gemm_flops: float | None = None) -> PlanSummary:
    """The readable plan of a model prepared by `dedicate_params`, of an `FnPlan` or of a `Plan`.
    gemm_flops: one device's GEMM FLOP/s in the NS iteration dtype (`measure_gemm_flops()`, or
    e.g. 4e14 for an H100 in bf16) adds the busiest rank's Newton-Schulz seconds per step."""
    if isinstance(source, nn.Module):
        source = dedicated_state(source, required=True).plan
    return _summarize(source, gemm_flops=gemm_flops)


class Slot:
    """One module attribute's use of an entry; the custom_ops._handles Handler of `handle`."""

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
        gather, args = torch.ops.dmuon.param_gather, (self.handle, list(e.shape), e.dtype, e.device)
        if self.st.reshard_after_forward:  # recomputed in backward instead of saved
            return checkpoint(gather, *args, use_reentrant=False)
        return gather(*args)

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


class _Z3Saver:
    """Eager Z3: saved-tensor hooks that keep (unit, group, view geometry) of gathered values and
    re-gather the unit when backward unpacks one."""

    def __init__(self, st: DedicatedState) -> None:
        self.st = st
        # storage ptr of a gathered buffer -> (unit, group index, the buffer: the ptr's witness)
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
            flat = self.st.scheduler.regather(unit).flats[i]
        return flat.as_strided(size, stride, offset)


def install(
    model: nn.Module, st: DedicatedState, uses: dict[nn.Module, list[tuple[str, Entry]]], depth: int
) -> None:
    """Set `st.scheduler` and its hooks for `uses` (module -> its (attribute, entry) pairs): a
    unit per layer, a bucket per module and owner, a slot per (module, attribute)."""
    modules = dict(model.named_modules(remove_duplicate=False))
    path = {m: f"{n}.{uses[m][0][0]}".lstrip(".") for n, m in modules.items() if m in uses}
    keys = layer_keys(path.values())
    unit_key = {m: keys[p] for m, p in path.items()}
    by_key: dict[str, list[Entry]] = {}  # an entry in several units is gathered for each
    for m, s in uses.items():
        by_key.setdefault(unit_key[m], []).extend(e for _, e in s)
    units = {key: Unit(key, make_groups(es)) for key, es in by_key.items()}
    buckets = {m: make_groups([e for _, e in s]) for m, s in uses.items()}
    st.scheduler = Scheduler(st, list(units.values()), sum(buckets.values(), ()), depth)
    for m, s in uses.items():
        of = {id(e): b for b in buckets[m] for e in b.entries}
        _module_hooks(m, [(n, Slot(e, units[unit_key[m]], of[id(e)], st)) for n, e in s], st)
    for key, unit in units.items():  # a block around the modules issues its unit's gathers first
        if (holder := modules.get(key)) is not None and holder not in uses:
            holder.register_forward_pre_hook(_eager(lambda u=unit: st.scheduler.open_unit(u)))
    # (a compiled root: no recorded order, every gather issued when needed)
    model.register_forward_pre_hook(_eager(lambda: st.scheduler.begin_forward()))
    model.register_forward_hook(_eager(lambda: st.scheduler.end_forward()))


def _eager(fn):
    """A module hook that calls `fn()`, except while torch.compile traces."""

    def hook(mod: nn.Module, *args):
        if not torch.compiler.is_compiling():
            fn()

    return hook


def _module_hooks(module: nn.Module, slots: list[tuple[str, Slot]], st: DedicatedState) -> None:
    """Set `slots` (of one unit) as instance attributes around every forward of `module`; compiled,
    each module issues the whole unit's gathers (dmuon::gather_start)."""
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
