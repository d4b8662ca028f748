"""`Muon`'s param groups: the model's parameters by kind ("muon": the dedicated matrices,
"adamw": the rest), fixed when the optimizer is built (proofs/torch_surface.md §5)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from ..optim._config import Config
from . import _fsdp_adapter as fsdp
from ._state import DedicatedState


class ModelGroups(torch.optim.Optimizer):
    """torch.optim.Optimizer whose groups hold the model's parameters, each once, as built by
    `init_groups`; `param_groups` puts them back where a list was replaced from outside by the
    same parameters mixed up, and refuses other tensors; `add_param_group` after building
    raises."""

    _building = True  # torch.optim.Optimizer.__init__ adds the groups

    def init_groups(self, groups: list[dict[str, Any]]) -> None:
        torch.optim.Optimizer.__init__(self, groups, {})
        # each group's parameter list as installed, and its own copy
        self._params = [(g["params"], list(g["params"])) for g in self._groups]
        self._building = False

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        """torch.optim.Optimizer's, with each group's parameters the model's, fixed when Muon
        is built: a list replaced from outside by the same parameters mixed up is put back
        (accelerate's FSDP2 `prepare` maps each parameter by `data_ptr()`, which every 0-size
        tensor shares: the placeholders, FSDP2's empty shards), by other tensors refused."""
        groups = self._groups
        if self._building:
            return groups
        for i, (g, (now, own)) in enumerate(zip(groups, self._params, strict=True)):
            if g["params"] is now:
                continue
            mine = {id(p) for _, ps in self._params for p in ps}
            if len(g["params"]) != len(own) or not {id(p) for p in g["params"]} <= mine:
                raise ValueError(
                    f"the {g['kind']!r} group's parameters were replaced by tensors that are not "
                    "the ones Muon(model) was built with: build Muon after the model is dedicated "
                    "and sharded, and do not change the model's parameters after"
                )
            g["params"] = list(own)
            self._params[i] = (g["params"], own)
        return groups

    @param_groups.setter
    def param_groups(self, groups: list[dict[str, Any]]) -> None:
        self._groups = groups

    def __setstate__(self, state: dict[str, Any]) -> None:
        # (load_state_dict sets its groups here, through __dict__, which the property shadows)
        state = dict(state)
        groups = state.pop("param_groups", None)
        super().__setstate__(state)
        if groups is not None:
            self.param_groups = groups

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if not self._building:
            raise ValueError(
                "Muon(model) already holds every parameter of the model, frozen ones too (a "
                "parameter unfrozen by requires_grad_(True) is updated from the next zero_grad() "
                "on), in its groups by kind: param_groups[i] with 'kind' 'muon' or 'adamw' take "
                "new hyperparameters. A tensor outside the model has no owner and no "
                "synchronized gradient: make it part of the model before dedicate_params, then "
                "build a new Muon"
            )
        super().add_param_group(param_group)


def model_groups(model: nn.Module, st: DedicatedState, config: Config) -> list[dict[str, Any]]:
    """The param groups "muon" (dedicated matrices) and "adamw" (the rest), where not empty;
    raises unless every gradient is synchronized (dedicated, or sharded by fully_shard)."""
    muon, adamw = [], []
    for p in model.parameters():
        (muon if (e := st.entry(p)) is not None and e.is_matrix else adamw).append(p)
    if dist.is_initialized() and dist.get_world_size() > 1:
        synced = fsdp.managed_params(model) | set(st.by_param)  # ids
        # a DTensor fully_shard does not manage is tensor-parallel: fine on a data mesh of one
        alone = st.shard_size * st.replicate_size == 1
        loose = [
            n
            for n, p in model.named_parameters()
            if id(p) not in synced and not (alone and fsdp.is_dtensor(p))
        ]
        if loose:
            raise ValueError(
                f"{loose[:3]}{'...' if len(loose) > 3 else ''} are neither dedicated nor "
                "sharded by fully_shard, so their gradients are never synchronized: call "
                "fully_shard on the model (over the data mesh) after dedicate_params, or "
                "dedicate_params(..., pure=True)"
            )
    hyper = config.groups()
    kinds = (("muon", muon), ("adamw", adamw))
    return [dict(params=ps, kind=kind, **hyper[kind]) for kind, ps in kinds if ps]
