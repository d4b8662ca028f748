"""dedicate_params: one owner rank per parameter; gather in forward, reduce-to-owner in backward.

Who holds what: dedicated/_entries.py; the scheduler: dedicated/_schedule.py; the hooks:
dedicated/_gather.py. Why the gradients come out exact: proofs/dedicate.md.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from custom_ops._collectives import broadcast_into

from ..comm._errors import phase
from ..comm._mesh import check_dtypes, check_meshes, master_dtype, own_group
from ..ns._dispatch import agreed_aspect
from ..planning._check import check_plan_consistent
from ..planning._partition import partition
from ..planning._summary import PlanSummary
from ..planning._summary import plan_summary as _summarize
from ..planning._view import RankView
from ..tp._layout import TensorMesh, check_crossing, find_tensor_mesh, layout_name, make_layout
from . import _fsdp_adapter as fsdp
from ._gather import install
from ._state import STATE_ATTR, DedicatedState, Entry, dedicated_state


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
) -> dict[str, int | tuple[int, int]]:
    """Give each parameter matched by `predicate(name, param)` one owner; call before fully_shard.

    mesh: the 1-D shard mesh (HSDP: `hsdp["shard"]`, with `replicate_mesh=hsdp["replicate"]`;
        tensor parallelism: `parallelize_module` over the 'tp' dim first, then the data dim of
        the same mesh, ('dp', 'tp') or ('replicate', 'shard', 'tp'); proofs/tensor_parallel.md).
    pure: dedicate every parameter (predicate ignored): matrices take Muon and the rest AdamW on
        their owners; no FSDP2 needed.
    param_dtype: the gather and compute dtype (as FSDP2's MixedPrecisionPolicy; default: the
        parameter's); the global owner keeps the master in the parameter's dtype promoted to at
        least fp32. reduce_dtype: the gradient sums' (default: param_dtype's).
    prefetch: layers whose gathers travel ahead of the one computing (the last forward's order;
        Z3 backward: reversed); 0: every gather and reduce blocks. Z3 holds up to prefetch + 1
        layers' gathered copies.
    Returns {name: owner}: the shard rank, or (shard, replica) under HSDP (tensor parallelism:
    the data coordinate; `plan.tensor_slot(name)` its root tensor rank).
    """
    if dedicated_state(model) is not None:
        raise ValueError("dedicate_params was already applied to this model")
    if fsdp.is_fully_sharded(model):
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
        # every parameter's layout over the tensor ranks joins the plan (and its check)
        tensor_size=1 if tmesh is None else tmesh.size(),
        layouts=None if tmesh is None else {n[0]: layout_name(p) for p, n in params.values()},
    )
    check_plan_consistent(plan)  # before any other collective: ranks that disagree all raise
    tp = None
    if tmesh is not None:
        tp = TensorMesh(tmesh, own_group(tmesh.get_group()), tmesh.get_local_rank(), tmesh.size())
    replica_rank = 0 if replicate_mesh is None else replicate_mesh.get_local_rank()
    st = DedicatedState(
        view=RankView(plan, mesh.get_local_rank(), replica_rank),
        shard_group=own_group(mesh.get_group()),
        replicate_group=None if replicate_mesh is None else own_group(replicate_mesh.get_group()),
        reshard_after_forward=reshard_after_forward,
        tensor=tp,
    )
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
    _broadcast_copies(st)
    setattr(model, STATE_ATTR, st)
    return {n: plan.owner(e.name) for e in st.entries for n in e.names}


def _mesh_device(mesh: DeviceMesh, current: torch.device) -> torch.device:
    """The mesh's device type (a CUDA mesh: the current CUDA device), so a model built on the
    CPU still communicates on the mesh's backend."""
    if mesh.device_type == "cuda" and current.type != "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return current if current.type == mesh.device_type else torch.device(mesh.device_type)


def _broadcast_copies(st: DedicatedState) -> None:
    """Equal copies from the start: tensor parallelism's whole copies take tensor rank 0's value,
    HSDP's local owners the global owner's (one broadcast per parameter)."""
    tp, rep = st.tensor, st.replicate_group
    mine = [e for e in st.entries if st.is_local_owner(e)]
    for e in mine:
        if tp is not None and not e.tp.sharded:
            with phase(f"dedicate_params (tensor-parallel sync of {e.name})"):
                broadcast_into(e.param.detach(), 0, tp.group, tp.size)
    for e in mine if rep is not None else ():
        # the global owner sends a cast copy of its master; `to` is a no-op elsewhere
        with phase(f"dedicate_params (replica sync of {e.name})"):
            broadcast_into(e.param.detach().to(e.dtype), e.owner_replica, rep, st.replicate_size)


def _state_of(model: nn.Module) -> DedicatedState:
    st = dedicated_state(model)
    if st is None:
        raise ValueError("this model has no dedicated parameters: call dedicate_params first")
    return st


def wait_gradients(model: nn.Module) -> None:
    """Block until backward's dedicated gradient reduces have landed in the global owners'
    `.grad`. Muon's `step`, `clip_grad_norm_`, `zero_grad`, the checkpoints and the next forward
    wait by themselves; call this before other code reads or zeroes those `.grad`s."""
    _state_of(model).scheduler.wait_reduces()


def set_requires_gradient_sync(model: nn.Module, requires_gradient_sync: bool) -> None:
    """Gradient accumulation without traffic, for dedicated parameters and FSDP2 alike. False:
    backward sums each dedicated gradient on every rank (a full-shape buffer each) and reduces
    nothing; True (default): the next backward reduces those sums with its own gradients. Sets
    FSDP2's switch on every `fully_shard`ed module too."""
    _state_of(model).scheduler.sync = bool(requires_gradient_sync)
    fsdp.set_requires_gradient_sync(model, requires_gradient_sync)


def plan_summary(source: object, *, gemm_flops: float | None = None) -> PlanSummary:
    """The readable plan of a model prepared by `dedicate_params`, of an `FnPlan` or of a `Plan`.
    gemm_flops: one device's GEMM FLOP/s in the NS iteration dtype (`measure_gemm_flops()`, or
    e.g. 4e14 for an H100 in bf16) adds the busiest rank's Newton-Schulz seconds per step."""
    if isinstance(source, nn.Module):
        source = _state_of(source).plan
    return _summarize(source, gemm_flops=gemm_flops)
