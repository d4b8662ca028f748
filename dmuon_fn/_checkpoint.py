"""Sharded checkpoints with torch.distributed.checkpoint (DCP), for both APIs.

Every rank writes only what it holds; nothing is gathered. The state dict each rank hands DCP:
- `model.<name>`: a dedicated parameter, ONLY in its global owner's dict (the object API's fp32
  master, or the functional API's value), so it is written exactly once; an FSDP2 parameter as
  its DTensor on every rank (DCP writes each shard once, deduplicating HSDP replicas); a plain
  parameter or buffer (replicated) on every rank, written once by DCP's dedup.
- `optim.<name>.<key>`: the optimizer state of a parameter on the rank(s) that update it: the
  global owner of a dedicated parameter (momentum, or AdamW's step and moments), every rank for
  FSDP2 shards (DTensor moments, a replicated 0-d step).
- `optim.param_groups.<kind>.<hyper>` (object API): lr, momentum, betas, ... on every rank;
  `optim.skipped_steps`, `optim.grad_norm`: the gradient guard's counters, on every rank.

Load reads the saved metadata on every rank (no collective), checks names and full shapes, then
each rank requests only what it holds under the NEW plan: the new global owner the value and
its optimizer state; under HSDP the other replicas' local owners the value too, cast on copy to
their own dtype (the model dtype, as the publish sends it); FSDP2 DTensors their new shards.
DCP's default load plan is the identity on each rank's local requests, so ranks may ask for
different keys. The plan is a pure function of shapes and mesh, so a new world size or mesh
shape needs nothing beyond this: the fresh model's owners are already the new ones.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from ._functional import State
from ._optim import Muon
from ._state import DedicatedState, dedicated_state

PathLike = str | os.PathLike


def save_checkpoint(path: PathLike, model: nn.Module, optimizer: Muon) -> None:
    """Save `model` (prepared by `dedicate_params`, then `fully_shard`) and its `Muon` optimizer
    to the directory `path`. Collective: every rank calls it with the same path and writes its
    own file; pending HSDP publishes are waited on first."""
    st = _require(model, optimizer)
    optimizer.wait_publish()
    _save(path, _object_dict(model, optimizer, st, load=False))


def load_checkpoint(path: PathLike, model: nn.Module, optimizer: Muon) -> None:
    """Load a checkpoint saved by `save_checkpoint` into `model` and `optimizer` in place, on any
    world size or mesh shape (owners follow the current plan). Param-group hyperparameters (lr,
    momentum, ...) come from the checkpoint, as with `Optimizer.load_state_dict`; state tensors
    keep their current dtype (`Muon(state_dtype=...)`). Collective; nothing is left pending."""
    st = _require(model, optimizer)
    optimizer.wait_publish()  # a background publish would overwrite the loaded values
    md = _metadata(path)
    sd = _object_dict(model, optimizer, st, load=True)
    _check(path, md, _object_shapes(model, optimizer, st))
    groups = {}
    for group in optimizer.param_groups:
        prefix = f"optim.param_groups.{group['kind']}."
        keys = sorted(k for k in md.state_dict_metadata if k.startswith(prefix))
        sd.update({k: group.get(k[len(prefix) :]) for k in keys})
        groups[prefix] = (group, keys)
    _load(path, sd)
    for prefix, (group, keys) in groups.items():
        for k in keys:
            group[k[len(prefix) :]] = sd[k]


def save_state(path: PathLike, state: State) -> None:
    """Save a functional `State` (params and optimizer state; the plan and Config are the
    caller's) to the directory `path`. Collective over the default group when initialized."""
    _save(path, _state_dict(state, load=False))


def load_state(path: PathLike, state: State) -> State:
    """A copy of `state` (freshly `init`-ed for the current plan and mesh) with the values saved
    by `save_state`, on any world size or mesh shape. Optimizer state keeps the dtype of
    `state` (its `Config.state_dtype`); the input is not modified. Collective."""
    md = _metadata(path)
    _check(path, md, _state_shapes(state))
    new = State(
        {n: t.clone() for n, t in state.params.items()},
        {n: type(s)(*(t.clone() for t in s)) for n, s in state.opt.items()},
        state.plan,
        state.config,
    )
    _load(path, _state_dict(new, load=True))
    return new


def _require(model: nn.Module, optimizer: Muon) -> DedicatedState:
    st = dedicated_state(model)
    if st is None:
        raise ValueError(
            "checkpointing needs a model prepared by dedicate_params(model, mesh, predicate) "
            "(then fully_shard) and its dmuon_fn.Muon optimizer; for the functional API use "
            "save_state / load_state"
        )
    if not isinstance(optimizer, Muon) or optimizer.st is not st:
        raise ValueError(
            f"optimizer must be the dmuon_fn.Muon built on this model, got {type(optimizer)}"
        )
    return st


def _object_dict(
    model: nn.Module, optimizer: Muon, st: DedicatedState, *, load: bool
) -> dict[str, Any]:
    """This rank's part: dedicated values on the global owner (load: every local owner), their
    optimizer state on the global owner; DTensors, plain params, buffers, FSDP2 params' state
    and (save) param-group hyperparameters on every rank."""
    sd: dict[str, Any] = {}
    names = {}
    for n, p in model.named_parameters():
        names[id(p)] = n
        e = st.entry(p)
        if e is None or st.is_global_owner(e) or (load and st.is_local_owner(e)):
            sd[f"model.{n}"] = p.detach()
    for n, b in _buffers(model).items():
        sd[f"model.{n}"] = b.detach()
    for group in optimizer.param_groups:
        if not load:  # load asks for the hyperparameters the checkpoint has (load_checkpoint)
            hyper = {k: v for k, v in group.items() if k not in ("params", "kind")}
            sd.update({f"optim.param_groups.{group['kind']}.{k}": v for k, v in hyper.items()})
        for p in group["params"]:
            e = st.entry(p)
            if e is None or st.is_global_owner(e):
                for k, v in optimizer.state[p].items():
                    sd[f"optim.{names[id(p)]}.{k}"] = v
    for k, v in _counters(optimizer).items():
        sd[f"optim.{k}"] = v
    return sd


def _counters(optimizer: Muon) -> dict[str, torch.Tensor]:
    """The guard's 0-d counters, the same on every rank (read-only for the step's arithmetic,
    kept so that a resumed run reports what an uninterrupted one would)."""
    return {"skipped_steps": optimizer.skipped_steps, "grad_norm": optimizer.grad_norm}


def _object_shapes(model: nn.Module, optimizer: Muon, st: DedicatedState) -> dict[str, tuple]:
    """Every tensor key of the checkpoint with its full shape (identical on every rank)."""
    full = {}
    for n, p in model.named_parameters():
        e = st.entry(p)
        full[id(p)] = (n, tuple(p.shape if e is None else e.shape))  # DTensor: the global shape
    shapes = {f"model.{n}": s for n, s in full.values()}
    shapes.update({f"model.{n}": tuple(b.shape) for n, b in _buffers(model).items()})
    for group in optimizer.param_groups:
        for p in group["params"]:
            n, s = full[id(p)]
            for k, v in optimizer.state[p].items():
                # Muon's state: 0-d step counts, the rest shaped like the parameter
                shapes[f"optim.{n}.{k}"] = () if v.ndim == 0 else s
    shapes.update({f"optim.{k}": () for k in _counters(optimizer)})
    return shapes


def _buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    sd = model.state_dict(keep_vars=True)
    return {n: b for n, b in sd.items() if n not in params and torch.is_tensor(b)}


def _state_dict(state: State, *, load: bool) -> dict[str, torch.Tensor]:
    """This rank's part of a functional State: each value on its global owner (load: every local
    owner), its optimizer state on the global owner."""
    fp, sd = state.plan, {}
    for n in fp.names:
        if fp.is_global_owner(n) or (load and fp.is_local_owner(n)):
            sd[f"model.{n}"] = state.params[n]
        if fp.is_global_owner(n):
            s = state.opt[n]
            sd.update({f"optim.{n}.{k}": v for k, v in zip(s._fields, s, strict=True)})
    return sd


def _state_shapes(state: State) -> dict[str, tuple]:
    fp, shapes = state.plan, {}
    for n in fp.names:
        shapes[f"model.{n}"] = fp.shape(n)
        s = state.opt[n]
        for k, v in zip(s._fields, s, strict=True):
            shapes[f"optim.{n}.{k}"] = () if v.ndim == 0 else fp.shape(n)
    return shapes


def _metadata(path: PathLike) -> Metadata:
    try:
        return dcp.FileSystemReader(path).read_metadata()
    except FileNotFoundError as err:
        raise FileNotFoundError(f"no checkpoint at {os.fspath(path)!r} (no .metadata)") from err


def _check(path: PathLike, md: Metadata, want: dict[str, tuple]) -> None:
    """Same names and full shapes as the model (every rank checks everything, so all raise)."""
    saved = {
        k: tuple(m.size)
        for k, m in md.state_dict_metadata.items()
        if isinstance(m, TensorStorageMetadata) and not k.startswith("optim.param_groups.")
    }
    for k, shape in want.items():
        if k not in saved:
            raise ValueError(
                f"checkpoint {os.fspath(path)!r} has no {k!r}: it was saved from a model with "
                "other parameter names (or another optimizer)"
            )
        if saved[k] != shape:
            raise ValueError(
                f"checkpoint {os.fspath(path)!r}: {k!r} has shape {saved[k]}, the model's is "
                f"{shape}"
            )
    extra = sorted(set(saved) - set(want))
    if extra:
        raise ValueError(
            f"checkpoint {os.fspath(path)!r} has {extra[0]!r}, which this model lacks "
            f"({len(extra)} such keys)"
        )


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _save(path: PathLike, sd: dict[str, Any]) -> None:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.save(sd, checkpoint_id=path, no_dist=not _distributed())


def _load(path: PathLike, sd: dict[str, Any]) -> None:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.load(sd, checkpoint_id=path, no_dist=not _distributed())
