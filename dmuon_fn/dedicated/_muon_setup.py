"""What `Muon` decides once, at construction: its param groups, every rank's placeholder state,
and the checks that the model is ready for it."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from ..optim._config import Config
from ..optim._update import init_state, state_items
from . import _fsdp_adapter as fsdp
from ._state import DedicatedState


def updates_here(st: DedicatedState, p: torch.Tensor) -> bool:
    """Whether this rank updates `p` at all: a dedicated parameter's global owner; every rank
    for the rest (FSDP2 shards, plain parameters)."""
    e = st.entry(p)
    return e is None or st.is_global_owner(e)


def steps_here(st: DedicatedState, p: torch.Tensor) -> bool:
    """Whether this step updates `p` on this rank."""
    if p.grad is None or not updates_here(st, p):
        return False
    e = st.entry(p)
    # a dedicated parameter no gradient reached this step (a stale grad kept by
    # zero_grad(set_to_none=False)) is skipped on every rank alike, as the publish does, so
    # replicas never drift apart
    return e is None or e.touched


def param_groups(model: nn.Module, st: DedicatedState, config: Config) -> list[dict[str, Any]]:
    """The torch.optim param groups: "muon" (dedicated matrices) and "adamw" (the rest), each
    with its hyperparameters from `config.groups()`; a group only where it has parameters."""
    muon, adamw = [], []
    for p in model.parameters():
        e = st.entry(p)
        (muon if e is not None and e.is_matrix else adamw).append(p)
    _check_synchronized(model, st, adamw)
    hyper = config.groups()
    kinds = (("muon", muon), ("adamw", adamw))
    return [dict(params=ps, kind=kind, **hyper[kind]) for kind, ps in kinds if ps]


def _check_synchronized(model: nn.Module, st: DedicatedState, adamw: list[torch.Tensor]) -> None:
    """Every parameter's gradient must be synchronized: dedicated, or sharded by fully_shard."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return
    # a DTensor that fully_shard does not manage is tensor-parallel: fine where the data mesh
    # has one rank, never synchronized over a larger one
    managed, data_parallel = fsdp.managed_params(model), st.shard_size * st.replicate_size
    names = {id(p): n for n, p in model.named_parameters()}
    loose = [
        names[id(p)]
        for p in adamw
        if st.entry(p) is None
        and id(p) not in managed
        and (data_parallel > 1 or not fsdp.is_dtensor(p))
    ]
    if loose:
        raise ValueError(
            f"{loose[:3]}{'...' if len(loose) > 3 else ''} are neither dedicated nor "
            "sharded by fully_shard, so their gradients are never synchronized: call "
            "fully_shard on the model (over the data mesh) after dedicate_params, or "
            "dedicate_params(..., pure=True)"
        )


def check_gather_in_step(st: DedicatedState, gather_in_step: bool) -> None:
    if gather_in_step and st.replicate_group is not None:
        raise ValueError(
            "gather_in_step=True runs on a 1-D mesh; under HSDP each step's publish already "
            "moves the new values in the background (replicate_async)"
        )
    if gather_in_step and st.scheduler.depth < 1:
        raise ValueError(
            "gather_in_step=True needs dedicate_params(..., prefetch >= 1): with prefetch 0 "
            "every gather blocks where it is issued"
        )


def placeholder_state(
    st: DedicatedState, kind: str, p: torch.Tensor, dtype: torch.dtype | None
) -> dict[str, torch.Tensor]:
    """`p`'s zero state in `dtype` (None: p's), 0-size where this rank does not update `p`, so
    every rank's `state_dict()` has the same keys; the step count lives on p's device, so a
    masked (skipped) step never syncs."""
    dt = dtype or p.dtype
    like = p if updates_here(st, p) else torch.empty(0, dtype=dt, device=p.device)
    return state_items(init_state(kind, like, dt))
