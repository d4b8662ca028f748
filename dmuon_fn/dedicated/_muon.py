"""Muon: the stateful shell over `optim/`'s pure updates (no math), for models prepared by
`dedicate_params`; it builds one `Config` from its arguments (proofs/step_notes.md).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch import Tensor

from ..ns._orthogonalize import NSConfig
from ..optim import _guard as guard
from ..optim._config import Config
from ..optim._update import KINDS, init_state, muon_apply, param_update, state_from, state_items
from . import _fsdp_adapter as fsdp
from ._muon_step import GradGuard, NextForward, exchange_momenta, steps_here, updates_here
from ._state import DedicatedState, dedicated_state


class Muon(torch.optim.Optimizer):
    """Param groups (hyperparameters from `Config.groups()`, LR schedulers welcome): "muon", the
    dedicated matrices, each updated by its global owner (under tensor parallelism by every
    tensor rank of it, under HSDP then published to the other replicas); "adamw", the rest
    (FSDP2 shards shard-locally, dedicated non-matrices by their owner, plain parameters on a
    world of one). Every rank's state has the same keys (0-size where it does not update): save
    and load every rank's `state_dict()`. gather_in_step=True (1-D mesh, prefetch >= 1): the
    step also issues the next forward's gathers; dedicated parameters must not change before
    that forward, whose root runs eagerly. `skipped_steps`, `grad_norm`: the guard's counters
    (0-d device tensors, int64 and float32)."""

    def __init__(
        self,
        model: nn.Module,
        lr: float = 0.02,
        momentum: float = 0.95,
        weight_decay: float = 0.0,
        ns_steps: int = 5,
        adamw_lr: float = 1e-3,
        adamw_betas: tuple[float, float] = (0.9, 0.999),
        adamw_weight_decay: float = 0.01,
        adamw_eps: float = 1e-8,
        nesterov: bool = True,
        replicate_async: bool = True,
        *,
        adjust_lr: str = "match_rms_adamw",
        coefficients: str | Iterable[Iterable[float]] = "polar_express",
        ns_method: str = "auto",
        ns_kernel: str | None = None,
        ns_dtype: torch.dtype | None = None,
        state_dtype: torch.dtype | None = torch.float32,
        max_grad_norm: float | None = None,
        nonfinite: str = "skip",
        gather_in_step: bool = False,
    ) -> None:
        st = dedicated_state(model)
        if st is None:
            raise ValueError(
                "Muon(model) needs dedicate_params(model, mesh, predicate) first: it decides "
                "which rank owns each matrix. Call dedicate_params, then fully_shard, then Muon"
            )
        ns = NSConfig(
            steps=ns_steps,
            coefficients=coefficients
            if isinstance(coefficients, str)
            else tuple(tuple(r) for r in coefficients),
            method=ns_method,
            kernel=ns_kernel,
            dtype=ns_dtype,
        )
        self.config = Config(
            lr=lr,
            momentum=momentum,
            weight_decay=weight_decay,
            adamw_lr=adamw_lr,
            adamw_betas=adamw_betas,
            adamw_weight_decay=adamw_weight_decay,
            adamw_eps=adamw_eps,
            nesterov=nesterov,
            adjust_lr=adjust_lr,
            ns=ns,
            state_dtype=state_dtype,
            max_grad_norm=max_grad_norm,
            nonfinite=nonfinite,
            host_sync=True,
        )
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
        self.st: DedicatedState = st
        self.replicate_async = replicate_async
        self.gather_in_step = bool(gather_in_step)
        self.ns_calls = 0  # Newton-Schulz runs on this rank, for tests and benchmarks
        super().__init__(param_groups(model, st, self.config), {})
        for group in self.param_groups:
            for p in group["params"]:
                # 0-size where this rank does not update p; the step count on p's device, so a
                # masked (skipped) step never syncs
                dt = state_dtype or p.dtype
                like = p if updates_here(st, p) else torch.empty(0, dtype=dt, device=p.device)
                self.state[p] = state_items(init_state(group["kind"], like, dt))
        self.guard = GradGuard(model, st, self.config, self.param_groups)
        self.ns = self.config.ns
        self.skipped_steps, self.grad_norm = self.guard.skipped_steps, self.guard.grad_norm
        kinds = repr([(g["kind"], len(g["params"])) for g in self.param_groups])
        self.config.check_setup(st.entries[0].param.device, **{"param groups": kinds})

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.st.scheduler.wait_reduces()
        ok = self.guard.check()
        hyper = {
            id(g): {
                **g,
                "lr": torch.tensor(g["lr"], dtype=torch.float32),
                "weight_decay": torch.tensor(g["weight_decay"], dtype=torch.float32),
            }
            for g in self.param_groups
        }
        # with gather_in_step, every unit's parameters are updated before its gather is issued
        # (unit by unit in the recorded order, the rest first); otherwise the order is the
        # param groups': the updates are independent, so the results are the same either way
        ahead = NextForward(self.st, self.gather_in_step)
        items = [(g, p) for g in self.param_groups for p in g["params"]]
        items.sort(key=lambda it: ahead.unit(it[1]))  # stable
        # tensor parallelism: every split matrix's Newton-Schulz first, on its root tensor rank
        exchange = None
        if self.st.tensor:
            exchange = exchange_momenta(self.st, items, self.state, self.config, ok)
            self.ns_calls += exchange.ns_calls
        for group, p in items:
            ahead.issue_before(p)
            self._update(group["kind"], p, hyper[id(group)], ok, exchange)
        ahead.issue_before(None)
        if exchange is not None:
            exchange.finish()
        self.st.publish(self.replicate_async)
        self.guard.forget()
        return loss

    def _update(self, kind: str, p: Tensor, group: dict, ok: Tensor | None, exchange) -> None:
        """`p`'s update where this rank makes it, written in place, masked by `ok`; `group` has
        lr and weight_decay as tensors."""
        if not steps_here(self.st, p):
            return
        e = self.st.entry(p)
        if e is not None:
            self.st.wait_publish(e)  # the last publish may still read this tensor
        cfg = self.config
        if kind == "muon" and e.tp is not None:  # orthogonalized in the exchange
            lr, wd = group["lr"], group["weight_decay"]
            O = exchange.result(e)
            new = muon_apply(
                p, O, lr=lr, weight_decay=wd, adjust_lr=cfg.adjust_lr, shape=e.full_shape
            )
            guard.write(p, new, ok)
            return
        state = {k: fsdp.local(v) for k, v in self.state[p].items()}
        lp, pure = fsdp.local(p), state_from(KINDS[kind], state)
        new, s = param_update(
            kind, lp, fsdp.local(p.grad), pure, group, adjust_lr=cfg.adjust_lr, ns=cfg.ns
        )
        self.ns_calls += kind == "muon"
        guard.write(lp, new, ok)
        for k, v in state_items(s).items():
            guard.write(state[k], v, ok)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """torch.nn.utils.clip_grad_norm_ over the unsharded model's gradients, on device: the
        norm before clipping (float32, 0-d). The next `step()` does not clip again."""
        guard.check_max_norm(max_norm)
        self.st.scheduler.wait_reduces()
        return self.guard.clip(max_norm)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.st.scheduler.wait_reduces()  # else they would land after the zeroing
        super().zero_grad(set_to_none)
        self.guard.forget()
        for e in self.st.entries:  # a parameter (un)frozen since: compiled blocks see it now
            e.follow_requires_grad()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As torch.optim.Optimizer's, then step counts on the parameter's device and the rest in
        `state_dtype` (the base class casts state to each parameter's dtype)."""
        super().load_state_dict(state_dict)
        dtype = self.config.state_dtype
        for p, state in self.state.items():
            for k, v in state.items():
                if k == "step":
                    state[k] = v.to(p.device)
                elif dtype is not None and torch.is_tensor(v) and v.is_floating_point():
                    state[k] = v.to(dtype)

    def wait_publish(self) -> None:
        """Block until the last backward's reduces and the last step's publishes (and gathers
        issued for the next forward) have landed."""
        self.st.scheduler.wait_reduces()
        self.st.scheduler.wait_ahead()
        for e in self.st.entries:
            self.st.wait_publish(e)


def param_groups(model: nn.Module, st: DedicatedState, config: Config) -> list[dict[str, Any]]:
    """The torch.optim param groups "muon" (dedicated matrices) and "adamw" (the rest), each
    only where it has parameters."""
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
