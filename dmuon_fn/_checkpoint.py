"""Sharded checkpoints with torch.distributed.checkpoint (DCP), one format for both APIs.

A checkpoint saved by either face loads into the other (same model, same predicate), on any
world size or mesh shape. Every rank writes only what it holds (nothing is gathered) under keys
`model.<name>` (a dedicated parameter's master in its global owner's dict only; FSDP2 DTensors,
plain parameters and buffers on every rank), `optim.<name>.<key>` (the state on the rank(s) that
update it: `_update.STATE_KEYS`), `optim.param_groups.<kind>.<hyper>` (`Config.groups()`'s names)
and `optim.skipped_steps`, `optim.grad_norm` (the guard's counters); who writes and reads each,
and why every value is written once: proofs/checkpoint.md. Load reads the saved metadata (no
collective), checks names and full shapes, then each rank requests only what it holds under the
NEW plan: the global owner the value and its state, HSDP's other local owners the value (cast on
copy to their compute dtype), FSDP2 DTensors their new shards.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from .dedicated._muon import Muon
from .dedicated._state import DedicatedState, dedicated_state
from .functional._step import State
from .optim._guard import counters
from .optim._update import STATE_KEYS, state_items

PathLike = str | os.PathLike
Keys = tuple[dict[str, Any], dict[str, tuple]]  # (this rank's part, every tensor key's full shape)
_GROUPS = "optim.param_groups."


def save_checkpoint(path: PathLike, model: nn.Module, optimizer: Muon) -> None:
    """Save `model` (prepared by `dedicate_params`, then `fully_shard`) and its `Muon` optimizer
    to the directory `path`. Collective: every rank calls it with the same path and writes its
    own file; pending HSDP publishes are waited on first."""
    st = _require(model, optimizer)
    optimizer.wait_publish()
    sd, _ = _object_keys(model, optimizer, st, load=False)
    hyper = {
        g["kind"]: {k: v for k, v in g.items() if k not in ("params", "kind")}
        for g in optimizer.param_groups
    }
    _dcp(dcp.save, path, sd | _group_entries(hyper))


def load_checkpoint(path: PathLike, model: nn.Module, optimizer: Muon) -> None:
    """Load a checkpoint saved by `save_checkpoint` into `model` and `optimizer` in place, on any
    world size or mesh shape (owners follow the current plan). Param-group hyperparameters (lr,
    momentum, ...) come from the checkpoint, as with `Optimizer.load_state_dict`; state tensors
    keep their current dtype (`Muon(state_dtype=...)`). Collective; nothing is left pending."""
    st = _require(model, optimizer)
    optimizer.wait_publish()  # a background publish would overwrite the loaded values
    st.scheduler.drop_ahead()  # gathers the step issued carry the values being replaced
    md = _metadata(path)
    sd, shapes = _object_keys(model, optimizer, st, load=True)
    _check(path, md, shapes)
    groups = {g["kind"]: g for g in optimizer.param_groups}
    keys = _group_keys(md, groups, known_only=False)
    sd.update({k: groups[kind].get(name) for k, (kind, name) in keys.items()})
    _dcp(dcp.load, path, sd)
    for k, (kind, name) in keys.items():
        groups[kind][name] = sd[k]


def save_state(
    path: PathLike,
    state: State,
    *,
    lr: float | torch.Tensor | None = None,
    adamw_lr: float | torch.Tensor | None = None,
    weight_decay: float | torch.Tensor | None = None,
    adamw_weight_decay: float | torch.Tensor | None = None,
) -> None:
    """Save a functional `State` (params, optimizer state, the guard's counters, and the
    Config's hyperparameters) to the directory `path`, in the object API's format. Pass the
    per-step values last given to `update` (lr, ...) when they are not the Config's, so the
    checkpoint records what the run used. Collective over the default group when initialized."""
    given = dict(
        lr=lr, adamw_lr=adamw_lr, weight_decay=weight_decay, adamw_weight_decay=adamw_weight_decay
    )
    # the values the run used, validated as a Config's (adamw_lr None: lr)
    used = {k: float(v) for k, v in given.items() if v is not None}
    hyper = dataclasses.replace(state.config, **used).groups()
    sd, _ = _state_keys(state, load=False)
    _dcp(dcp.save, path, sd | _group_entries({kind: hyper[kind] for kind in _kinds(state)}))


def load_state(path: PathLike, state: State) -> State:
    """A copy of `state` (freshly `init`-ed for the current plan and mesh) with the values saved
    by `save_state` or `save_checkpoint`, on any world size or mesh shape, and a Config whose
    hyperparameters (lr, momentum, betas, ...) are the checkpoint's. Optimizer state keeps the
    dtype of `state` (its `Config.state_dtype`), parameters the dtypes `init` gave them; the
    input is not modified. Collective."""
    md = _metadata(path)
    new = State(
        {n: t.clone() for n, t in state.params.items()},
        {n: type(s)(*(t.clone() for t in s)) for n, s in state.opt.items()},
        state.plan,
        state.config,
        *_counters_of(state),
    )
    sd, shapes = _state_keys(new, load=True)
    _check(path, md, shapes)
    hyper = state.config.groups()
    keys = _group_keys(md, {kind: hyper[kind] for kind in _kinds(state)}, known_only=True)
    sd.update({k: hyper[kind][name] for k, (kind, name) in keys.items()})
    _dcp(dcp.load, path, sd)
    loaded: dict[str, dict[str, Any]] = {}
    for k, (kind, name) in keys.items():
        loaded.setdefault(kind, {})[name] = sd[k]
    config = state.config.with_groups(loaded)
    # the same object when nothing changed: a compiled step guarded on it need not recompile
    return new._replace(config=state.config if config == state.config else config)


def _group_entries(hyper: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Param-group hyperparameters {kind: {name: value}} keyed as the checkpoint keys them."""
    return {f"{_GROUPS}{kind}.{k}": v for kind, g in hyper.items() for k, v in g.items()}


def _group_keys(md: Metadata, groups: dict[str, Any], *, known_only: bool) -> dict[str, tuple]:
    """The checkpoint's param-group keys of the kinds in `groups`, as {key: (kind, name)}
    (known_only: only the names `groups[kind]` has)."""
    out = {}
    for k in sorted(md.state_dict_metadata):
        if k.startswith(_GROUPS):
            kind, name = k[len(_GROUPS) :].split(".", 1)
            if kind in groups and (name in groups[kind] or not known_only):
                out[k] = (kind, name)
    return out


def _kinds(state: State) -> list[str]:
    """The param-group kinds a plan has (the object API makes a group only when non-empty)."""
    fp = state.plan
    return [k for k, has in (("muon", fp.muon), ("adamw", set(fp.names) - fp.muon)) if has]


def _counters_of(state: State) -> tuple[torch.Tensor, torch.Tensor]:
    """The State's guard counters (zeros for a State built without them)."""
    device = next(iter(state.params.values())).device
    fresh = counters(device)
    got = (state.skipped_steps, state.grad_norm)
    return tuple(f if g is None else g.clone() for f, g in zip(fresh, got, strict=True))


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


def _object_keys(model: nn.Module, optimizer: Muon, st: DedicatedState, *, load: bool) -> Keys:
    """Dedicated values on the global owner (load: every local owner), their optimizer state on
    the global owner; DTensors, plain params, buffers, FSDP2 params' state and the guard's
    counters on every rank."""
    sd: dict[str, Any] = {}
    shapes: dict[str, tuple] = {}
    for n, p in model.named_parameters():
        e = st.entry(p)
        full = tuple(p.shape if e is None else e.full_shape)  # DTensor: global
        held = e is None or st.is_global_owner(e)
        shapes[f"model.{n}"] = full
        if held or (load and st.is_local_owner(e)):
            sd[f"model.{n}"] = _part(e, p.detach())
        for k, v in optimizer.state[p].items():
            shapes[f"optim.{n}.{k}"] = () if v.ndim == 0 else full  # 0-d: step counts
            if held:
                sd[f"optim.{n}.{k}"] = v if v.ndim == 0 else _part(e, v)
    for n, b in _buffers(model).items():
        sd[f"model.{n}"], shapes[f"model.{n}"] = b.detach(), tuple(b.shape)
    return _with_counters(sd, shapes, optimizer.skipped_steps, optimizer.grad_norm)


def _part(e, t: torch.Tensor) -> torch.Tensor:
    """A dedicated tensor as the checkpoint keys it: under tensor parallelism this rank's part
    as a DTensor of the whole (DCP reshards it to any tensor-parallel degree on load)."""
    return t if e is None or e.tp is None else e.tp.to_checkpoint(t)


def _with_counters(sd, shapes, skipped: torch.Tensor, norm: torch.Tensor) -> Keys:
    """With the guard's 0-d counters, the same on every rank (kept so that a resumed run reports
    what an uninterrupted one would)."""
    sd.update({"optim.skipped_steps": skipped, "optim.grad_norm": norm})
    return sd, shapes | {"optim.skipped_steps": (), "optim.grad_norm": ()}


def _buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    sd = model.state_dict(keep_vars=True)
    return {n: b for n, b in sd.items() if n not in params and torch.is_tensor(b)}


def _state_keys(state: State, *, load: bool) -> Keys:
    """A functional State's: each value on its global owner (load: every local owner), its
    optimizer state on the global owner; the counters on every rank."""
    fp, sd, shapes = state.plan, {}, {}
    for n in fp.names:
        items = state_items(state.opt[n])
        shapes[f"model.{n}"] = fp.shape(n)
        shapes.update(
            {f"optim.{n}.{k}": () if v.ndim == 0 else fp.shape(n) for k, v in items.items()}
        )
        if fp.is_global_owner(n) or (load and fp.is_local_owner(n)):
            sd[f"model.{n}"] = state.params[n]
        if fp.is_global_owner(n):
            sd.update({f"optim.{n}.{k}": v for k, v in items.items()})
    skipped, norm = (state.skipped_steps, state.grad_norm) if load else _counters_of(state)
    return _with_counters(sd, shapes, skipped, norm)


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
            raise ValueError(f"checkpoint {os.fspath(path)!r} has no {k!r}: {_why(k, saved)}")
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


def _why(key: str, saved: dict[str, tuple]) -> str:
    """Why a checkpoint lacks `key`: another optimizer for that parameter, or another model."""
    if key.startswith("optim."):
        name = key[len("optim.") :].rsplit(".", 1)[0]
        if f"model.{name}" in saved:
            kinds = {k: t.__name__[: -len("State")] for t, ks in STATE_KEYS.items() for k in ks}
            mine = f"optim.{name}."
            theirs = sorted(
                {kinds.get(k.rsplit(".", 1)[1], "?") for k in saved if k.startswith(mine)}
            )
            return (
                f"{name} was saved with {'/'.join(theirs)} state, this run gives it "
                f"{kinds.get(key.rsplit('.', 1)[1], '?')}: plan (or dedicate_params) with the "
                "predicate the checkpoint was saved with"
            )
    return "it was saved from a model with other parameter names (or another optimizer)"


def _dcp(fn, path: PathLike, sd: dict[str, Any]) -> None:
    """dcp.save or dcp.load; without a process group (one process) where none is initialized."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        fn(sd, checkpoint_id=path, no_dist=not (dist.is_available() and dist.is_initialized()))
