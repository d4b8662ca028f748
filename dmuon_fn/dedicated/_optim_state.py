"""`Muon`'s state in torch's distributed state dict (proofs/torch_surface.md §4). While
`get_optimizer_state_dict` / `set_optimizer_state_dict` (and `get_state_dict` /
`set_state_dict`) run, the state of each dedicated parameter is a DTensor of its whole shape,
laid out as the model's values are (dedicated/_state_dict.py), so DCP saves it once and reloads
it on any world size; `optimizer.state_dict()` called alone stays per rank, without
communication, and loads back at the same world size and plan."""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.distributed.checkpoint.state_dict as dsd
from torch.distributed.tensor import DTensor

from ..comm._mesh import master_dtype
from ._state_dict import entries_of, flat_mesh, load_whole, owner_slot, whole_value

_PATCHED = "_dmuon_patched"


def _dedicated(opt, sd: dict):
    """(state dict key, parameter, its entries) of every dedicated parameter with state in
    `sd` (keyed by index or by name, in param-group order as torch's optimizers pack it)."""
    keys = [k for g in sd["param_groups"] for k in g["params"]]
    params = [p for g in opt.param_groups for p in g["params"]]
    for key, p in zip(keys, params, strict=True):
        if opt.st.entry(p) is not None and key in sd["state"]:
            yield key, p, entries_of(opt.st, p)


def whole_state(opt, sd: dict) -> dict:
    """`sd` (`Optimizer.state_dict()`'s) with each dedicated parameter's state whole: a DTensor
    (`whole_value` of the global owners' state tensors), a 0-d value (a step count) the global
    owner's. Collective."""
    st = opt.st
    for key, _, es in _dedicated(opt, sd):
        dtype = opt.config.state_dtype or master_dtype(es[0].dtype)
        state = sd["state"][key] = dict(sd["state"][key])  # (not the optimizer's own dict)
        for k, v in state.items():
            if not torch.is_tensor(v):
                continue
            if v.ndim == 0:
                _, ranks = flat_mesh(st)
                owner = ranks[owner_slot(st, es[0])]
                state[k] = v.clone()
                dist.broadcast(state[k], src=owner)
            else:
                state[k] = whole_value(st, es, lambda e, k=k: opt.state[e.param][k], dtype)
    return sd


def held_state(opt, sd: dict) -> dict:
    """`sd` with each dedicated parameter's whole state (a DTensor: collective; a plain tensor
    of the whole shape: each global owner copies its part) replaced by what this rank holds;
    a per-rank dict (`optimizer.state_dict()`) passes if it matches this rank's state."""
    st = opt.st
    for key, p, es in _dedicated(opt, sd):
        whole, mine = tuple(es[0].full_shape), opt.state[p]
        state = sd["state"][key] = dict(sd["state"][key])
        for k, v in state.items():
            held = mine.get(k)
            if not torch.is_tensor(v) or v.ndim == 0 or held is None:
                continue
            if isinstance(v, DTensor) or tuple(v.shape) == whole != tuple(held.shape):

                def put(e, k=k):
                    return opt.state[e.param][k] if st.is_global_owner(e) else None

                load_whole(st, es, v, f"optimizer state {k} of {es[0].names[0]}", put)
                state[k] = held
            elif v.shape != held.shape:
                raise ValueError(
                    f"optimizer state {k!r} of {es[0].names[0]} has shape {tuple(v.shape)}, "
                    f"neither this rank's part {tuple(held.shape)} nor the whole {whole}: a "
                    "rank's optimizer.state_dict() loads only at the world size and plan it "
                    "was saved at; save with torch.distributed.checkpoint.state_dict's "
                    "get_optimizer_state_dict (or dmuon_fn.save_checkpoint) to load elsewhere"
                )
    return sd


def _muons(optimizers) -> list:
    """The `Muon`s among `optimizers`, also where a trainer wraps one (accelerate's
    AcceleratedOptimizer, Lightning's LightningOptimizer: `.optimizer`, `._optimizer`)."""
    found = []
    for o in optimizers:
        for _ in range(4):  # (a wrapper of a wrapper)
            if hasattr(type(o), "whole_state"):
                found.append(o)
                break
            o = getattr(o, "optimizer", None) or getattr(o, "_optimizer", None)
    return found


def install() -> None:
    """While torch's distributed state-dict functions get or load an optimizer's state dict,
    `Muon`s (optimizers with `whole_state`) give and take whole states (idempotent)."""
    for name in ("_get_optim_state_dict", "_load_optim_state_dict"):
        original = getattr(dsd, name)
        if getattr(original, _PATCHED, False):
            continue

        @functools.wraps(original)
        def patched(model, optimizers, *args, _original=original, **kwargs):
            ours = _muons(optimizers)
            before = [o.whole_state for o in ours]
            for o in ours:
                o.whole_state = True
            try:
                return _original(model, optimizers, *args, **kwargs)
            finally:
                for o, b in zip(ours, before, strict=True):
                    o.whole_state = b

        setattr(patched, _PATCHED, True)
        setattr(dsd, name, patched)
