"""dedicate_params: one owner rank per parameter, its full value gathered around each module's
forward and its gradient reduced to the owner (proofs/dedicate.md, proofs/dedicated_notes.md)."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
import torch.nn as nn
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from ..comm._mesh import check_dtypes, check_meshes, master_dtype, own_group, team_groups
from ..ns._blocks import Blocks, block_shapes, model_blocks
from ..ns._dispatch import agreed_gram
from ..planning._check import check_plan_consistent
from ..planning._partition import partition
from ..planning._slices import parse_piece
from ..planning._summary import PlanSummary
from ..planning._summary import plan_summary as _summarize
from ..planning._tensor import LOCAL
from ..planning._view import RankView
from ..tp._layout import TensorMesh, check_crossing, find_tensor_mesh, layout_name, make_layout
from . import _fsdp_adapter as fsdp
from ._hooks import install
from ._state import LIVE, STATE_ATTR, DedicatedState, Entry, dedicated_state
from ._state_dict import install as state_dict_hooks


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
    teams: Mapping[str, int] | None = None,
    max_bytes_per_rank: int | None = None,
) -> dict[str, int | tuple[int, int]]:
    """Give each parameter matched by `predicate(name, param)` one owner; call before fully_shard.

    mesh: the 1-D shard mesh (HSDP: `hsdp["shard"]`, with `replicate_mesh=hsdp["replicate"]`;
        tensor parallelism: `parallelize_module` over the 'tp' dim first, then the data dim of
        the same mesh, ('dp', 'tp') or ('replicate', 'shard', 'tp'); proofs/tensor_parallel.md).
    reshard_after_forward: True, Z3 (gathered again in backward, but the last layer, which the
        backward starts with); False, Z2 (the copies kept).
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
    teams: {name: k} puts a matrix on a team of k owners of its slices, which run its
        Newton-Schulz together (`partition`'s; the planner gives the costliest matrices teams
        by itself).
    max_bytes_per_rank: the most resident bytes (fp32 masters and optimizer states, HSDP copies)
        the plan may give a rank; a plan over it is refused naming the smallest world size that
        fits (`partition`'s).
    Returns {name: owner}: the shard rank, or (shard, replica) under HSDP (tensor parallelism:
    the data coordinate; `plan.tensor_slot(name)` its root tensor rank).
    """
    if dedicated_state(model) is not None:
        raise ValueError("dedicate_params was already applied to this model")
    if fsdp.fsdp_modules(model):
        raise ValueError(
            "dedicate_params must run before fully_shard: FSDP2 already manages parameters of "
            "this model. Call dedicate_params(model, ...) first, then fully_shard (a model "
            "built on the meta device: dedicate_params, fully_shard, then model.to_empty and "
            "its init; docs/large_models.md)"
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

    _check_meta(model)
    R = 1 if replicate_mesh is None else replicate_mesh.size()
    shapes = {names[0]: tuple(p.shape) for p, names in params.values()}
    device = _mesh_device(mesh, next(iter(params.values()))[0].device)
    plan = partition(
        shapes,
        mesh.size() * R,
        replicate_size=R,
        elementwise=[n for n, shape in shapes.items() if len(shape) < 2],
        **agreed_gram(device),  # every rank plans (and runs) rank 0's dispatch
        tensor_size=1 if tmesh is None else tmesh.size(),
        layouts=None if tmesh is None else {n[0]: layout_name(p) for p, n in params.values()},
        blocks=model_blocks(model, [n for n, s in shapes.items() if len(s) >= 2], blocks),
        teams=teams,
        max_bytes_per_rank=max_bytes_per_rank,
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
    st.teams = team_groups(plan, view.shard_rank, replica)
    LIVE.add(st)
    of_old: dict[int, list[Entry]] = {}  # id(the parameter replaced) -> its entries (pieces)
    for pid, (p, names) in params.items():
        old = fsdp.local(p)  # (tensor parallelism: this tensor rank's part)
        pieces = plan.pieces(names[0])
        dt = param_dtype or old.dtype
        for piece in pieces:
            cut = parse_piece(piece) if len(pieces) > 1 else None
            part, e_names = (old, names) if cut is None else (old[cut.index], (piece,))
            owner, device = st.view.coords(piece), _mesh_device(mesh, old.device)
            e = Entry(
                piece, tuple(e_names), part.shape, dt, reduce_dtype or dt, *owner, part, device
            )
            if cut is not None:
                e.piece, e.whole = cut, old.shape
            if tp is not None:
                e.tp = make_layout(p, tp, plan.tensor_slot(names[0]))
            e.param = _held(st, e, part, old.requires_grad)
            of_old.setdefault(pid, []).append(e)
            st.entries.append(e)
            st.by_param[id(e.param)] = e

    uses: dict[nn.Module, list[tuple[str, list[Entry]]]] = {}  # module -> (attribute, entries)s
    held_by: dict[nn.Module, dict[str, tuple[Entry, list[Entry]]]] = {}  # the entry it holds
    for module in model.modules():
        for pname, p in list(module._parameters.items()):
            if p is not None and (es := of_old.get(id(p))) is not None:
                # a rank holds at most one piece: that one's parameter, else the first's (0-size)
                held = next((e for e in es if st.is_local_owner(e)), es[0])
                module._parameters[pname] = held.param
                for e in es if len(es) > 1 else ():
                    e.holder = held.param
                uses.setdefault(module, []).append((pname, es))
                held_by.setdefault(module, {})[pname] = (held, es)
    for module, attrs in held_by.items():
        _follow_apply(module, st, attrs)
    install(model, st, uses, prefetch)
    state_dict_hooks(st, uses)
    st.unsynced = True
    st.sync_copies("dedicate_params")  # a meta model's: once it is initialized
    setattr(model, STATE_ATTR, st)
    return {n: plan.owner(e.name) for e in st.entries for n in e.names}


def _held(st: DedicatedState, e: Entry, old: Tensor, requires_grad: bool) -> nn.Parameter:
    """What this rank holds of `e`: the master (global owner), the full copy in `e.dtype`
    (local owner), a 0-size placeholder elsewhere; of a meta `old`, the first two on the meta
    device (storage comes with `model.to_empty`, values with the user's init)."""
    dtype = master_dtype(old.dtype) if st.is_global_owner(e) else e.dtype
    if old.is_meta and st.is_local_owner(e):
        data = torch.empty(old.shape, dtype=dtype, device="meta")
    elif st.is_local_owner(e):
        data = old.detach().to(e.device, dtype, copy=True)
    else:
        data = torch.empty(0, dtype=dtype, device=e.device)
    p = nn.Parameter(data, requires_grad=requires_grad)
    setattr(p, fsdp.DEDICATED_ATTR, True)
    return p


def _follow_apply(module: nn.Module, st: DedicatedState, attrs: dict) -> None:
    """Keep `module`'s dedicated attributes `attrs` ({name: (the entry it holds, the
    parameter's entries)}) the entries' parameters through `module._apply` (`to_empty`, `to`),
    which may put new Parameter objects in their place (meta to a device always does): the
    entry takes the new one; a tied attribute whose entry another module already moved takes
    that one, so ties stay tied. A cast is refused before anything moves (see `_check_cast`)."""

    def _apply(fn, recurse=True):
        _check_cast(fn, attrs)
        before = {k: module._parameters[k] for k in attrs}
        out = type(module)._apply(module, fn, recurse)  # FSDP2 swaps the class: look it up now
        for k, (held, es) in attrs.items():
            new = module._parameters[k]
            if new is before[k]:
                continue
            if held.param is not before[k]:  # tied: moved with another module
                module._parameters[k] = held.param
                continue
            del st.by_param[id(held.param)]
            setattr(new, fsdp.DEDICATED_ATTR, True)
            held.param, st.by_param[id(new)] = new, held
            for e in es if len(es) > 1 else ():
                e.holder = new
        return out

    module._apply = _apply


def _check_cast(fn: Callable[[Tensor], Tensor], attrs: dict) -> None:
    """Raise ValueError where `fn` (what `module._apply` maps over tensors: `to(dtype)`,
    `half()`, a trainer's precision plugin) changes the dtype of the tensors a dedicated
    parameter is gathered in or mastered in: the gathers keep the dtype of `dedicate_params`
    and the master would be rounded. Decided from dtypes alone (a 0-size probe), so every rank
    raises alike, placeholders or not."""
    for held, _ in attrs.values():
        for dtype in (held.dtype, master_dtype(held.dtype)):
            cast = fn(torch.empty(0, dtype=dtype)).dtype
            if cast != dtype:
                raise ValueError(
                    f"{held.name} is dedicated in {held.dtype} (its master in "
                    f"{master_dtype(held.dtype)}), fixed at dedicate_params: a cast to {cast} "
                    f"after it would keep its gathers in {held.dtype} and round the master. "
                    "Cast the model before dedicate_params, or pass dedicate_params(..., "
                    "param_dtype=) for lower-precision compute on fp32 masters (FSDP2: "
                    "MixedPrecisionPolicy); a trainer's precision that casts the model after "
                    "setup (Lightning's 'bf16-true', '16-true') is such a cast: use its "
                    "'32-true' with param_dtype"
                )


def _check_meta(model: nn.Module) -> None:
    """A model with parameters on the meta device must be all meta, buffers included:
    `model.to_empty` would replace a real tensor's values with uninitialized memory."""
    tensors = [*model.named_parameters(), *model.named_buffers()]
    meta = [n for n, t in tensors if fsdp.local(t).is_meta]
    real = [(n, t.device) for n, t in tensors if not fsdp.local(t).is_meta]
    if meta and real:
        raise ValueError(
            f"{meta[0]} is on the meta device but {real[0][0]} on {real[0][1]} ({len(real)} "
            "real tensors in a meta model): model.to_empty would leave the real ones "
            "uninitialized. Build the whole model under torch.device('meta') and set every "
            "value in its init after to_empty (buffers too), or build it all on a real device"
        )


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


def plan_summary(
    source: object, *, gemm_flops: float | None = None, bandwidth: float | None = None
) -> PlanSummary:
    """The readable plan of a model prepared by `dedicate_params`, of an `FnPlan` or of a `Plan`.
    gemm_flops: one device's GEMM FLOP/s in the NS iteration dtype (`measure_gemm_flops()`, or
    e.g. 4e14 for an H100 in bf16) adds the busiest rank's Newton-Schulz seconds per step;
    bandwidth: the bytes/s of a team's collectives (e.g. 4e11) adds them to the seconds."""
    if isinstance(source, nn.Module):
        source = dedicated_state(source, required=True).plan
    return _summarize(source, gemm_flops=gemm_flops, bandwidth=bandwidth)
