"""The one module that touches FSDP2 and DTensor internals. `install` (at `import dmuon_fn`)
patches `fully_shard`: dedicated parameters join its `ignored_params`, a container without
`forward` (torch 2.13 rejects it) is skipped with a one-time note (proofs/dedicated_notes.md);
and `FSDPModule.set_gradient_divide_factor`: the dedicated parameters that module groups take
the same factor (torchtitan sets 1.0 on every module and divides the loss itself)."""

from __future__ import annotations

import functools
import warnings
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

DEDICATED_ATTR = "_dmuon_dedicated"
_STATE_KEY = "__composable_api_state_key"
_REGISTRY_KEY = "__composable_api_registry_key"
_noted_containers = False


def is_dtensor(p: torch.Tensor) -> bool:
    return isinstance(p, DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def counted_here(t: torch.Tensor) -> bool:
    """Whether this rank's local part of `t` counts in a sum over the job: a DTensor's on the
    rank at coordinate 0 of every mesh dim it is replicated over; a plain tensor's always."""
    if not isinstance(t, DTensor):
        return True
    coord = t.device_mesh.get_coordinate()
    if coord is None:  # this rank is not in the tensor's mesh
        return False
    return all(c == 0 for c, pl in zip(coord, t.placements, strict=True) if pl.is_replicate())


def mesh_ranks(t: torch.Tensor) -> set[int]:
    """The global ranks of a DTensor's mesh (a plain tensor: none)."""
    return set(t.device_mesh.mesh.flatten().tolist()) if isinstance(t, DTensor) else set()


def shard_like(full: torch.Tensor, d: DTensor) -> torch.Tensor:
    """This rank's local part of `full` (a plain tensor of `d`'s global shape, equal on every
    rank) as `d` lays it out (FSDP2's Shard(0), TP's placements; no communication)."""
    return distribute_tensor(full, d.device_mesh, d.placements, src_data_rank=None).to_local()


def replicated_like(value: torch.Tensor, d: DTensor) -> DTensor:
    """`value` (a plain tensor, equal on every rank) as a DTensor replicated over `d`'s mesh."""
    mesh = d.device_mesh
    return DTensor.from_local(value, mesh, [Replicate()] * mesh.ndim, run_check=False)


def dtensor_unwrap(t: torch.Tensor) -> tuple[torch.Tensor, Any] | None:
    """(local tensor, spec) of a DTensor (what `dtensor_wrap` takes), else None."""
    return (t._local_tensor, t._spec) if isinstance(t, DTensor) else None


def dtensor_wrap(local: torch.Tensor, spec: Any, requires_grad: bool) -> torch.Tensor:
    """A DTensor of `spec` around `local` (no copy, no autograd node)."""
    return DTensor(local, spec, requires_grad=requires_grad)


def fsdp_modules(model: nn.Module) -> list[FSDPModule]:
    """The modules `fully_shard` was applied to (DTensors alone may be TP's)."""
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def set_requires_gradient_sync(model: nn.Module, requires_gradient_sync: bool) -> None:
    for m in fsdp_modules(model):
        m.set_requires_gradient_sync(requires_gradient_sync, recurse=False)


def managed_params(model: nn.Module) -> set[int]:
    """ids of the sharded DTensors `fully_shard` manages in `model`."""
    groups = [g for m in fsdp_modules(model) for g in m._get_fsdp_state()._fsdp_param_groups]
    return {id(fp.sharded_param) for g in groups for fp in g.fsdp_params}


def grouped_params(module: nn.Module) -> list[nn.Parameter]:
    """The parameters `fully_shard(module)` groups, dedicated ones included (which it ignores):
    its own and its descendants', less those under a nested `fully_shard`."""
    out, todo = [], [module]
    while todo:
        m = todo.pop()
        out += [p for p in m._parameters.values() if p is not None]
        todo += [c for c in m.children() if not isinstance(c, FSDPModule)]
    return out


def _follow_divide_factor() -> None:
    """Patch `FSDPModule.set_gradient_divide_factor`, once: after FSDP2's own, every dedicated
    parameter the module groups lands its gradient as the sum divided by `factor` (an owner's
    `Entry.grad_divide`; dedicated/_schedule.py), as FSDP2 divides the module's other ones."""
    from ._state import LIVE

    original = FSDPModule.set_gradient_divide_factor
    if getattr(original, "_dmuon_patched", False):
        return

    @functools.wraps(original)
    def set_gradient_divide_factor(self, factor: float) -> None:
        original(self, factor)
        held = {id(p) for p in grouped_params(self)}
        for st in list(LIVE):
            for e in st.entries:
                if id(e.param if e.holder is None else e.holder) in held:
                    e.grad_divide = None if factor is None else float(factor)

    set_gradient_divide_factor._dmuon_patched = True
    FSDPModule.set_gradient_divide_factor = set_gradient_divide_factor


def install() -> None:
    """Patch `fully_shard`'s function inside its `contract` wrapper, once (idempotent), and
    `FSDPModule.set_gradient_divide_factor`."""
    _follow_divide_factor()
    for cell in fully_shard.__closure__ or ():
        if callable(f := cell.cell_contents) and getattr(f, "__name__", "") == "fully_shard":
            break
    else:
        raise RuntimeError("dmuon_fn cannot find fully_shard's implementation to patch")
    original = cell.cell_contents
    if getattr(original, "_dmuon_patched", False):
        return

    @functools.wraps(original)
    def patched(module, *args, **kwargs):
        global _noted_containers
        container = isinstance(module, nn.ModuleList | nn.ModuleDict)
        if container and type(module).forward is nn.Module.forward:  # without forward
            # undo the state `contract` registered before calling us: FSDP2 must not treat
            # the container as a nested fully_shard root, or the enclosing group skips it
            module.__dict__.get(_STATE_KEY, {}).pop(patched, None)
            module.__dict__.get(_REGISTRY_KEY, {}).pop("fully_shard", None)
            if not _noted_containers:
                _noted_containers = True
                warnings.warn(
                    f"dmuon_fn: fully_shard({type(module).__name__}) skipped: a container "
                    "without forward cannot be sharded on its own (torch 2.13); its parameters "
                    "join the enclosing fully_shard group",
                    stacklevel=3,
                )
            return module
        modules = [module] if isinstance(module, nn.Module) else list(module)
        params = (p for m in modules for p in m.parameters())
        dedicated = {p for p in params if getattr(p, DEDICATED_ATTR, False)}
        if dedicated:
            kwargs["ignored_params"] = set(kwargs.get("ignored_params") or ()) | dedicated
        return original(module, *args, **kwargs)

    patched._dmuon_patched = True
    cell.cell_contents = patched
