"""dedicate_params: one owner rank per parameter; gather in forward, reduce-to-owner in backward.

Who holds what (G ranks in the shard group, R replicas under HSDP):
- the *local owner* of a parameter is shard rank `owner_shard` in every replica; it holds the
  full parameter between steps. The *global owner*, (owner_shard, owner_replica), holds it in
  fp32 (the master, when the model is lower precision), its optimizer state, and is the only
  rank that runs Newton-Schulz on it. Every other rank holds a 0-size placeholder.
- forward: right before a module that uses the parameter runs, the local owner broadcasts it
  (in the model dtype, or `param_dtype`) to its shard group; the module computes with that
  gathered copy. Every collective failure names its phase (`_guard.CollectiveError`).
- backward: the autograd transpose of that broadcast, a sum onto the local owner (stage 1); under
  HSDP a second sum across the replicate group onto the global owner (stage 2); the global owner
  divides by G·R (the data-parallel average) into `param.grad`.
- Z3 (`reshard_after_forward=True`): the gathered copy is not kept for backward: it is
  broadcast again when backward needs it. Z2 keeps it until backward has used it.
- a block compiled with torch.compile traces these gathers and reduces into its graph, one
  graph for identical blocks on every rank (`_gather`).
- after the optimizer step (HSDP), the global owner publishes the new value, in the model dtype,
  to the local owners of the other replicas; with `replicate_async` the publish runs in the
  background and is waited on right before the parameter's next gather.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from custom_ops._collectives import broadcast_into
from custom_ops._handles import new_handle

from . import _fsdp_adapter as fsdp
from ._dispatch import agreed_aspect
from ._gather import ParamHandler, install_hooks
from ._guard import phase
from ._partition import Plan, partition
from ._plan_check import check_plan_consistent

Predicate = Callable[[str, nn.Parameter], bool]
STATE_ATTR = "_dmuon_state"


@dataclass(eq=False)
class Entry:
    """One dedicated parameter (tied names share one entry)."""

    name: str
    names: tuple[str, ...]
    shape: torch.Size
    dtype: torch.dtype  # compute and gather dtype (the model's, or param_dtype)
    reduce_dtype: torch.dtype  # gradient reduction dtype
    owner_shard: int
    owner_replica: int
    param: nn.Parameter  # full on local owners (fp32 master on the global owner), else 0-size
    publish: dist.Work | None = None
    # names this entry to dmuon::param_gather/param_reduce (custom_ops._handles); requires grad
    # as `param` does, and backward sets its .grad when it reaches the gather
    handle: torch.Tensor | None = None
    handler: ParamHandler | None = None
    device: torch.device | None = None  # param's: compiled hooks read this, never `param`

    @property
    def is_matrix(self) -> bool:
        return len(self.shape) >= 2

    @property
    def touched(self) -> bool:
        """Backward reached this parameter's gather since the last step (the same on every rank
        that took part)."""
        return self.handle.grad is not None

    def next_step(self) -> None:
        """Forget this step's `touched`; follow `param.requires_grad` (set since by the user)."""
        self.handle.grad = None
        self.follow_requires_grad()

    def follow_requires_grad(self) -> None:
        """The handle requires grad as the parameter does: a compiled block reads the handle's
        flag, never the parameter's."""
        if self.handle.requires_grad != self.param.requires_grad:
            self.handle.requires_grad_(self.param.requires_grad)


@dataclass(eq=False)
class DedicatedState:
    """What `dedicate_params` attaches to the model (`model._dmuon_state`)."""

    plan: Plan
    entries: list[Entry]
    shard_group: dist.ProcessGroup
    replicate_group: dist.ProcessGroup | None
    shard_rank: int
    replica_rank: int
    shard_size: int
    replicate_size: int
    reshard_after_forward: bool
    by_param: dict[int, Entry] = field(default_factory=dict)

    def is_local_owner(self, e: Entry) -> bool:
        return self.shard_rank == e.owner_shard

    def is_global_owner(self, e: Entry) -> bool:
        return self.shard_rank == e.owner_shard and self.replica_rank == e.owner_replica

    def entry(self, p: torch.Tensor) -> Entry | None:
        return self.by_param.get(id(p))

    def owners(self) -> dict[str, int | tuple[int, int]]:
        out: dict[str, int | tuple[int, int]] = {}
        for e in self.entries:
            for n in e.names:
                out[n] = (
                    e.owner_shard if self.replicate_size == 1 else (e.owner_shard, e.owner_replica)
                )
        return out

    def wait_publish(self, e: Entry) -> None:
        if e.publish is not None:
            with phase(f"the HSDP publish of {e.name}"):
                e.publish.wait()
            e.publish = None

    def publish(self, asynchronous: bool) -> None:
        """Global owners send updated values to the other replicas (no-op on a 1-D mesh)."""
        if self.replicate_group is None:
            for e in self.entries:
                e.next_step()
            return
        for e in self.entries:
            touched = e.touched
            e.next_step()
            if not (self.is_local_owner(e) and touched):
                continue
            self.wait_publish(e)
            p = e.param
            # the parameter itself, except the global owner's fp32 master, sent as a cast copy
            # (receivers hold the model dtype, so `to` is a no-op for them)
            buf = p.detach().to(e.dtype)
            src = dist.get_global_rank(self.replicate_group, e.owner_replica)
            with phase(f"step (HSDP publish of {e.name})"):
                work = dist.broadcast(buf, src=src, group=self.replicate_group, async_op=True)
            e.publish = work
            if not asynchronous:
                self.wait_publish(e)


def _check_meshes(mesh: DeviceMesh, replicate_mesh: DeviceMesh | None) -> None:
    if not isinstance(mesh, DeviceMesh) or mesh.ndim != 1:
        raise ValueError(
            f"mesh must be a 1-D DeviceMesh (for HSDP pass hsdp['shard'] and "
            f"replicate_mesh=hsdp['replicate']), got {mesh!r}"
        )
    if replicate_mesh is None:
        return
    if not isinstance(replicate_mesh, DeviceMesh) or replicate_mesh.ndim != 1:
        raise ValueError(f"replicate_mesh must be a 1-D DeviceMesh, got {replicate_mesh!r}")
    names = (mesh.mesh_dim_names, replicate_mesh.mesh_dim_names)
    if names != (("shard",), ("replicate",)):
        raise ValueError(
            "HSDP needs a 2-D mesh named ('replicate', 'shard'): build it with "
            "init_device_mesh(dev, (R, G), mesh_dim_names=('replicate', 'shard')) and pass "
            f"mesh=hsdp['shard'], replicate_mesh=hsdp['replicate']; got dim names {names}"
        )
    if mesh.size() * replicate_mesh.size() != dist.get_world_size():
        raise ValueError(
            f"mesh ({mesh.size()} ranks) and replicate_mesh ({replicate_mesh.size()} ranks) "
            f"disagree with the world size {dist.get_world_size()}: they must be the 'shard' and "
            "'replicate' dims of one 2-D mesh"
        )
    shard_ranks = set(mesh.mesh.flatten().tolist())
    rep_ranks = set(replicate_mesh.mesh.flatten().tolist())
    if shard_ranks & rep_ranks != {dist.get_rank()}:
        raise ValueError(
            "mesh and replicate_mesh disagree: they must be the 'shard' and 'replicate' dims of "
            "the same 2-D mesh (their groups must cross in exactly this rank)"
        )


def dedicate_params(
    model: nn.Module,
    mesh: DeviceMesh,
    predicate: Predicate | None = None,
    *,
    replicate_mesh: DeviceMesh | None = None,
    reshard_after_forward: bool = True,
    pure: bool = False,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
) -> dict[str, int | tuple[int, int]]:
    """Give each parameter matched by `predicate(name, param)` one owner; call before fully_shard.

    mesh: the 1-D shard mesh (HSDP: `hsdp["shard"]`, with `replicate_mesh=hsdp["replicate"]`).
    pure: dedicate every parameter (predicate ignored): matrices take Muon and the rest AdamW on
        their owners, so the model trains with no FSDP2 at all.
    param_dtype: mixed precision, as FSDP2's MixedPrecisionPolicy: dedicated parameters are
        gathered and computed with in this dtype (e.g. bf16) while the global owner keeps the
        master in the parameter's own dtype promoted to at least fp32. Default: the parameter's.
    reduce_dtype: dtype of the gradient sums (default: param_dtype's).
    Returns {name: owner}: the shard rank on a 1-D mesh, (shard, replica) under HSDP.
    """
    fsdp.require_installed()
    if getattr(model, STATE_ATTR, None) is not None:
        raise ValueError("dedicate_params was already applied to this model")
    if fsdp.is_fully_sharded(model):
        raise ValueError(
            "dedicate_params must run before fully_shard: FSDP2 already manages parameters of "
            "this model. Call dedicate_params(model, ...) first, then fully_shard"
        )
    if predicate is None and not pure:
        raise ValueError("pass a predicate(name, param) -> bool, or pure=True to dedicate all")
    _check_meshes(mesh, replicate_mesh)
    for what, dt in (("param_dtype", param_dtype), ("reduce_dtype", reduce_dtype)):
        if dt is not None and not (isinstance(dt, torch.dtype) and dt.is_floating_point):
            raise ValueError(f"{what} must be a floating torch.dtype or None, got {dt!r}")

    seen: dict[int, list[str]] = {}
    params: dict[int, nn.Parameter] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if pure or predicate(name, p):
            seen.setdefault(id(p), []).append(name)
            params[id(p)] = p
    if not seen:
        raise ValueError(
            "predicate matched no parameter: e.g. predicate=lambda n, p: 'proj' in n and "
            "p.ndim == 2 dedicates the projection matrices"
        )
    if not pure:
        for pid, names in seen.items():
            if params[pid].ndim < 2:
                raise ValueError(
                    f"{names[0]} (shape {tuple(params[pid].shape)}) matched the predicate but is "
                    "not a matrix: Muon orthogonalizes matrices. Exclude it from the predicate "
                    "(FSDP2 shards it and Muon applies AdamW), or pass pure=True to dedicate "
                    "every parameter with AdamW on the owners of non-matrices"
                )

    G = mesh.size()
    R = 1 if replicate_mesh is None else replicate_mesh.size()
    names_in_order = [names[0] for names in seen.values()]
    shapes = {seen[pid][0]: tuple(params[pid].shape) for pid in seen}
    non_matrix = [n for n in names_in_order if len(shapes[n]) < 2]
    device = _mesh_device(mesh, next(iter(params.values())).device)
    aspect = agreed_aspect(device)  # every rank plans (and runs) rank 0's NS dispatch
    plan = partition(
        shapes, G * R, replicate_size=R, elementwise=non_matrix, gram_min_aspect=aspect
    )
    check_plan_consistent(plan)

    st = DedicatedState(
        plan=plan,
        entries=[],
        shard_group=mesh.get_group(),
        replicate_group=None if replicate_mesh is None else replicate_mesh.get_group(),
        shard_rank=mesh.get_local_rank(),
        replica_rank=0 if replicate_mesh is None else replicate_mesh.get_local_rank(),
        shard_size=G,
        replicate_size=R,
        reshard_after_forward=reshard_after_forward,
    )
    new_params: dict[int, nn.Parameter] = {}
    for pid, names in seen.items():
        old = params[pid]
        owner = plan.owner(names[0])
        shard, rep = owner if isinstance(owner, tuple) else (owner, 0)
        dt = param_dtype or old.dtype
        e = Entry(names[0], tuple(names), old.shape, dt, reduce_dtype or dt, shard, rep, old)
        device = _mesh_device(mesh, old.device)
        if st.is_global_owner(e):
            data = old.detach().to(device, torch.promote_types(old.dtype, torch.float32), copy=True)
        elif st.is_local_owner(e):
            data = old.detach().to(device, dt, copy=True)
        else:
            data = torch.empty(0, dtype=dt, device=device)
        e.param = nn.Parameter(data, requires_grad=old.requires_grad)
        setattr(e.param, fsdp.DEDICATED_ATTR, True)
        e.device = device
        e.handler = ParamHandler(e, st)
        e.handle = new_handle(e.handler).requires_grad_(e.param.requires_grad)
        new_params[pid] = e.param
        st.entries.append(e)
        st.by_param[id(e.param)] = e

    slots: dict[nn.Module, list[tuple[str, Entry]]] = {}
    for module in model.modules():
        for pname, p in list(module._parameters.items()):
            if p is not None and id(p) in new_params:
                new = new_params[id(p)]
                module._parameters[pname] = new
                slots.setdefault(module, []).append((pname, st.by_param[id(new)]))
    for module, s in slots.items():
        install_hooks(module, s, st)
    _sync_replicas(st)
    setattr(model, STATE_ATTR, st)
    return st.owners()


def _mesh_device(mesh: DeviceMesh, current: torch.device) -> torch.device:
    """Where dedicated parameters live: the mesh's device type (the current CUDA device for a
    CUDA mesh), so a model built on the CPU still communicates on the mesh's backend."""
    if mesh.device_type == "cuda" and current.type != "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return current if current.type == mesh.device_type else torch.device(mesh.device_type)


def _sync_replicas(st: DedicatedState) -> None:
    """HSDP: start every replica's local owner from the global owner's value (one broadcast per
    parameter over the replicate group), so replicas agree even if their initializations did
    not."""
    if st.replicate_group is None:
        return
    for e in st.entries:
        if st.is_local_owner(e):
            buf = e.param.detach().to(e.dtype)
            with phase(f"dedicate_params (replica sync of {e.name})"):
                broadcast_into(buf, e.owner_replica, st.replicate_group, st.replicate_size)
            if not st.is_global_owner(e):
                e.param.detach().copy_(buf)


def dedicated_state(model: nn.Module) -> DedicatedState | None:
    return getattr(model, STATE_ATTR, None)
