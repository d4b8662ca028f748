"""Sharded checkpoints with torch.distributed.checkpoint (DCP), one format for both faces, either
loading into the other (same model and predicate) on any world size or mesh shape; each rank
writes and reads only what it holds. Keys: `model.<name>`, `optim.<name>.<key>`
(`_update.STATE_KEYS`), `optim.param_groups.<kind>.<hyper>` (`Config.groups()`),
`optim.skipped_steps`, `optim.grad_norm`, `blocks.<name>` (each Muon matrix's blocks spec: a
load under other specs warns); who writes and reads each: proofs/checkpoint.md."""

from __future__ import annotations

import dataclasses
import functools
import os
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.utils._pytree import tree_map_only

from .dedicated._muon import Muon
from .dedicated._state import DedicatedState, dedicated_state
from .functional._step import State
from .optim._guard import counters
from .optim._update import STATE_KEYS, state_items
from .planning._slices import parse_piece

PathLike = str | os.PathLike
Keys = tuple[dict[str, Any], dict[str, tuple]]  # (this rank's part, every tensor key's full shape)
_GROUPS = "optim.param_groups."
_BLOCKS = "blocks."  # + name: how a Muon matrix is made of matrices (`Blocks` spelling)


def save_checkpoint(path: PathLike, model: nn.Module, optimizer: Muon) -> None:
    """Save `model` (prepared by `dedicate_params`, then `fully_shard`) and its `Muon` to the
    directory `path`. Collective (same path on every rank)."""
    st = _require(model, optimizer)
    optimizer.wait_publish()
    sd, _ = _object_keys(model, optimizer, st, load=False)
    hyper = {
        g["kind"]: {k: v for k, v in g.items() if k not in ("params", "kind")}
        for g in optimizer.param_groups
    }
    _dcp(dcp.save, path, sd | _group_entries(hyper))


def load_checkpoint(path: PathLike, model: nn.Module, optimizer: Muon) -> None:
    """Load a checkpoint into `model` and `optimizer` in place, on any world size or mesh shape.
    Param-group hyperparameters come from the checkpoint (as `Optimizer.load_state_dict`);
    state tensors keep their dtype (`Muon(state_dtype=...)`). Collective."""
    st = _require(model, optimizer)
    optimizer.wait_publish()  # a background publish would overwrite the loaded values
    st.scheduler.drop_ahead()  # gathers the step issued carry the values being replaced
    groups = {g["kind"]: g for g in optimizer.param_groups}
    loaded = _load(path, *_object_keys(model, optimizer, st, load=True), groups, known_only=False)
    for kind, values in loaded.items():
        groups[kind].update(values)


def save_state(
    path: PathLike,
    state: State,
    *,
    lr: float | torch.Tensor | None = None,
    adamw_lr: float | torch.Tensor | None = None,
    weight_decay: float | torch.Tensor | None = None,
    adamw_weight_decay: float | torch.Tensor | None = None,
) -> None:
    """Save a functional `State` and its Config's hyperparameters to the directory `path`, in
    the object API's format; pass the per-step values last given to `update` where they are not
    the Config's. Collective when torch.distributed is initialized."""
    given = dict(
        lr=lr, adamw_lr=adamw_lr, weight_decay=weight_decay, adamw_weight_decay=adamw_weight_decay
    )
    used = {k: float(v) for k, v in given.items() if v is not None}  # checked as a Config's
    hyper = dataclasses.replace(state.config, **used).groups()
    sd, _ = _state_keys(state, load=False)
    _dcp(dcp.save, path, sd | _group_entries({kind: hyper[kind] for kind in _kinds(state)}))


def load_state(path: PathLike, state: State) -> State:
    """A copy of `state` (freshly `init`-ed) with the values of a checkpoint of either face, on
    any world size or mesh shape, and a Config with its hyperparameters. Tensors keep `state`'s
    dtypes; `state` is not modified. Collective."""
    new = tree_map_only(torch.Tensor, torch.clone, _counted(state))
    hyper = state.config.groups()
    groups = {kind: hyper[kind] for kind in _kinds(state)}
    loaded = _load(path, *_state_keys(new, load=True), groups, known_only=True)
    config = state.config.with_groups(loaded)
    # the same object when nothing changed: a compiled step guarded on it need not recompile
    return new._replace(config=state.config if config == state.config else config)


def _group_entries(hyper: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """{kind: {name: value}} as checkpoint entries."""
    return {f"{_GROUPS}{kind}.{k}": v for kind, g in hyper.items() for k, v in g.items()}


def _load(
    path: PathLike, sd: dict, shapes: dict, groups: dict[str, Any], *, known_only: bool
) -> dict[str, dict[str, Any]]:
    """Check the keys and full shapes against `shapes`, load `sd` and the param-group values of
    `groups`' kinds (known_only: of names `groups[kind]` has): {kind: {name: value}}."""
    try:
        md = dcp.FileSystemReader(path).read_metadata()
    except FileNotFoundError as err:
        raise FileNotFoundError(f"no checkpoint at {os.fspath(path)!r} (no .metadata)") from err
    _check(path, md, shapes)
    keys = {}
    for k in sorted(md.state_dict_metadata):
        if k.startswith(_GROUPS):
            kind, name = k[len(_GROUPS) :].split(".", 1)
            if kind in groups and (name in groups[kind] or not known_only):
                keys[k] = (kind, name)
    sd.update({k: groups[kind].get(name) for k, (kind, name) in keys.items()})
    specs = {k: sd.pop(k) for k in [k for k in sd if k.startswith(_BLOCKS)]}
    sd.update({k: v for k, v in specs.items() if k in md.state_dict_metadata})  # (older: none)
    _dcp(dcp.load, path, sd)
    changed = [(k[len(_BLOCKS) :], sd[k], v) for k, v in specs.items() if sd.get(k, v) != v]
    if changed:
        n, old, new = changed[0]
        warnings.warn(
            f"checkpoint {os.fspath(path)!r} was saved with {n} made of matrices as {old!r}, this "
            f"run orthogonalizes it as {new!r} ({len(changed)} such matrices): its momentum "
            "carries on under the new blocks (pass blocks= as saved to keep the old math)",
            stacklevel=3,
        )
    loaded: dict[str, dict[str, Any]] = {}
    for k, (kind, name) in keys.items():
        loaded.setdefault(kind, {})[name] = sd[k]
    return loaded


def _kinds(state: State) -> list[str]:
    """The param-group kinds the plan has parameters for (as the object API's groups)."""
    fp = state.plan
    return [k for k, has in (("muon", fp.muon), ("adamw", set(fp.names) - fp.muon)) if has]


def _counted(state: State) -> State:
    """`state` with zeroed guard counters where it has none."""
    fresh = counters(next(iter(state.params.values())).device)
    got = (state.skipped_steps, state.grad_norm)
    skipped, norm = (f if g is None else g for f, g in zip(fresh, got, strict=True))
    return state._replace(skipped_steps=skipped, grad_norm=norm)


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
    """The object face's entries this rank holds, and every key's full shape."""
    sd, shapes = {}, {}
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
        if e is not None and e.is_matrix:
            sd[f"{_BLOCKS}{n}"] = str(st.plan.blocks_of(n))
    for n, b in _persistent_buffers(model):
        sd[f"model.{n}"], shapes[f"model.{n}"] = b.detach(), tuple(b.shape)
    return _with_counters(sd, shapes, optimizer.skipped_steps, optimizer.grad_norm)


def _persistent_buffers(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, buffer) of the buffers `model.state_dict()` holds (not its parameters: that
    would send every dedicated one, dedicated/_state_dict.py)."""
    out = []
    for prefix, m in model.named_modules():
        for n, b in m._buffers.items():
            if b is not None and n not in m._non_persistent_buffers_set:
                out.append((f"{prefix}.{n}" if prefix else n, b))
    return out


def _part(e, t: torch.Tensor) -> torch.Tensor:
    """A dedicated tensor as saved (tensor parallelism: its part, a DTensor of the whole; a
    piece: its part of the whole)."""
    if e is not None and e.whole is not None:
        return _piece_of(t, e.piece.offsets, e.whole)
    return t if e is None or e.tp is None else e.tp.to_checkpoint(t)


def _piece_of(t: torch.Tensor, at: tuple[int, ...] | None, whole: tuple[int, ...]) -> torch.Tensor:
    """`t` as saved: a piece (`at` its offsets along its leading dims) as `_Piece`, else (and
    0-d step counts) itself."""
    return t if at is None or t.ndim == 0 else _Piece.of(t, at, torch.Size(whole))


class _Piece(torch.Tensor):
    """a box of a tensor of shape `whole` from offsets `at` (its leading dims'), as DCP reads and
    writes a chunk of a larger tensor (its checkpointable protocol, as DTensor's); it shares the
    piece's storage, so a load writes into it."""

    _at: torch.Size
    _whole: torch.Size

    @staticmethod
    def of(t: torch.Tensor, offsets: tuple[int, ...], whole: torch.Size) -> _Piece:
        x = torch.Tensor._make_subclass(_Piece, t)
        at = (*offsets, *[0] * (t.ndim - len(offsets)))
        x._at, x._whole = torch.Size(at), torch.Size(whole)
        return x

    def size(self, dim: int | None = None):  # what DCP checks against the saved size
        return self._whole if dim is None else self._whole[dim]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        return self.as_subclass(torch.Tensor)

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=self._at, sizes=self.as_subclass(torch.Tensor).size())]

    def __create_write_items__(self, fqn: str, obj: object) -> list[WriteItem]:
        local = self.as_subclass(torch.Tensor)
        data = TensorWriteData(
            chunk=self.__create_chunk_list__()[0],
            properties=TensorProperties.create_from_tensor(local),
            size=self._whole,
        )
        return [WriteItem(MetadataIndex(fqn, self._at), WriteItemType.SHARD, tensor_data=data)]


def _with_counters(sd, shapes, skipped: torch.Tensor, norm: torch.Tensor) -> Keys:
    """With the guard's 0-d counters (on every rank)."""
    sd.update({"optim.skipped_steps": skipped, "optim.grad_norm": norm})
    return sd, shapes | {"optim.skipped_steps": (), "optim.grad_norm": ()}


def _state_keys(state: State, *, load: bool) -> Keys:
    """The functional face's entries this rank holds, and every key's full shape."""
    state, sd, shapes = _counted(state), {}, {}
    fp = state.plan
    for n in fp.names:
        items = state_items(state.opt[n])
        shapes[f"model.{n}"] = fp.shape(n)
        shapes |= {f"optim.{n}.{k}": () if v.ndim == 0 else fp.shape(n) for k, v in items.items()}
        held = fp.view.held(n)
        at = None if held in (None, n) else parse_piece(held).offsets
        part = functools.partial(_piece_of, at=at, whole=fp.shape(n))
        if fp.is_global_owner(n) or (load and fp.is_local_owner(n)):
            sd[f"model.{n}"] = part(state.params[n])
        if fp.is_global_owner(n):
            sd.update({f"optim.{n}.{k}": part(v) for k, v in items.items()})
        if n in fp.muon:
            sd[f"{_BLOCKS}{n}"] = str(fp.partition.blocks_of(n))
    return _with_counters(sd, shapes, state.skipped_steps, state.grad_norm)


def _check(path: PathLike, md: Metadata, want: dict[str, tuple]) -> None:
    """Same names and full shapes as the model, on every rank (so all raise alike)."""
    where = f"checkpoint {os.fspath(path)!r}"
    saved = {
        k: tuple(m.size)
        for k, m in md.state_dict_metadata.items()
        if isinstance(m, TensorStorageMetadata) and not k.startswith(_GROUPS)
    }
    for k, shape in want.items():
        if k not in saved:
            raise ValueError(f"{where} has no {k!r}: {_why(k, saved)}")
        if saved[k] != shape:
            raise ValueError(f"{where}: {k!r} has shape {saved[k]}, the model's is {shape}")
    extra = sorted(set(saved) - set(want))
    if extra:
        raise ValueError(
            f"{where} has {extra[0]!r}, which this model lacks ({len(extra)} such keys)"
        )


def _why(key: str, saved: dict[str, tuple]) -> str:
    """Why a checkpoint lacks `key`: another optimizer for that parameter, or another model."""
    name, _, field = key.removeprefix("optim.").rpartition(".")
    if not (key.startswith("optim.") and f"model.{name}" in saved):
        return "it was saved from a model with other parameter names (or another optimizer)"
    kinds = {k: t.__name__[: -len("State")] for t, ks in STATE_KEYS.items() for k in ks}
    mine = f"optim.{name}."
    theirs = sorted({kinds.get(k.rpartition(".")[2], "?") for k in saved if k.startswith(mine)})
    return (
        f"{name} was saved with {'/'.join(theirs)} state, this run gives it "
        f"{kinds.get(field, '?')}: plan (or dedicate_params) with the predicate the checkpoint "
        "was saved with"
    )


def _dcp(fn, path: PathLike, sd: dict[str, Any]) -> None:
    """dcp.save or dcp.load (without a process group where none is initialized)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        fn(sd, checkpoint_id=path, no_dist=not (dist.is_available() and dist.is_initialized()))
