"""Muon: the stateful optimizer over `optim/`'s pure updates for models prepared by
`dedicate_params`, with its gradient guard (proofs/step_notes.md, proofs/guard.md)."""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch import Tensor

from ..comm._mesh import phase
from ..ns._blocks import block_count
from ..ns._orthogonalize import NSConfig
from ..optim import _guard as guard
from ..optim._config import Config
from ..optim._qk_clip import ClipHeads, LogitTracker, check_clip_heads, clip_params, stacked_maxes
from ..optim._update import (
    KINDS,
    MuonState,
    init_state,
    muon_apply,
    muon_momentum,
    param_update,
    state_from,
    state_items,
)
from ..tp._layout import TensorExchange
from . import _fsdp_adapter as fsdp
from ._grad_guard import GradGuard, steps_here, updates_here
from ._groups import ModelGroups, model_groups
from ._optim_state import held_state, whole_state
from ._state import DedicatedState, Entry, dedicated_state


def _exchanged(e: Entry | None) -> bool:
    """Whether the step's `TensorExchange` orthogonalizes `e`: tensor parallel, except whole
    experts on each tensor rank (expert parallelism), orthogonalized where they lie."""
    return e is not None and e.tp is not None and not e.tp.local


class Muon(ModelGroups):
    """Param groups (hyperparameters from `Config.groups()`, LR schedulers welcome): "muon", the
    dedicated matrices, each updated by its global owner (tensor parallelism: by each tensor rank
    of it; HSDP: then published to the other replicas); "adamw", the rest (FSDP2 shards
    shard-locally, dedicated non-matrices by their owner, plain parameters on a world of one).
    Every rank's state has the same keys (0-size where it does not update): save and load every
    rank's `state_dict()`. gather_in_step=True (1-D mesh, prefetch >= 1): the step also issues the
    next forward's gathers; dedicated parameters must not change before that forward, whose root
    runs eagerly. Guard counters: `skipped_steps` (int64), `grad_norm` (float32), 0-d on device."""

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
        qk_clip_tau: float | None = None,
        qk_clip_alpha: float = 0.5,
        qk_clip_heads: Mapping[Hashable, ClipHeads] | None = None,
        logit_tracker: LogitTracker | None = None,
    ) -> None:
        st = _ready(model, gather_in_step)
        ns = NSConfig(ns_steps, coefficients, method=ns_method, kernel=ns_kernel, dtype=ns_dtype)
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
            qk_clip_tau=qk_clip_tau,
            qk_clip_alpha=qk_clip_alpha,
            qk_clip_heads=qk_clip_heads or (),
        )
        self.st: DedicatedState = st
        self.replicate_async = replicate_async
        self.gather_in_step = bool(gather_in_step)
        self.ns_calls = 0  # Newton-Schulz runs on this rank, for tests and benchmarks
        self.ns_blocks = 0  # and the matrices (blocks, experts) they orthogonalized
        self.tracker, self.clip_entries = logit_tracker, _clip_entries(st, self.config)
        if self.config.qk_clip_heads and (logit_tracker is None or gather_in_step):
            raise ValueError(
                "QK-clip (qk_clip_heads) needs logit_tracker=, the LogitTracker the attentions "
                "observe q and k with, and runs without gather_in_step (it changes the weights "
                "after every update)"
            )
        self.init_groups(model_groups(model, st, self.config))
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
        # the guard's all-reduce flies while this rank computes its first update (proofs/guard.md)
        early = self.guard.early() and self.st.tensor is None
        if early:
            self.guard.start()
        ok = None if early else self.guard.check()
        as_tensors = ("lr", "weight_decay")  # hyperparameters the updates take as 0-d tensors
        hyper = {
            id(g): {**g, **{k: torch.tensor(g[k], dtype=torch.float32) for k in as_tensors}}
            for g in self.param_groups
        }
        sched = self.st.scheduler
        first = sched.step_gathers(self.gather_in_step)  # id(param) -> its first unit
        items = [(g, p) for g in self.param_groups for p in g["params"]]
        items.sort(key=lambda it: first.get(id(it[1]), -1))  # stable (proofs/prefetch.md claim 9)
        if early and not self.gather_in_step:  # the largest matrix first: its Newton-Schulz
            items.sort(key=lambda it: _heavy_first(self.st, *it))  # hides the verdict's wait
        exchange = self._exchange(items, ok) if self.st.tensor else None
        for group, p in items:
            sched.step_gather_until(first.get(id(p), -1))
            writes = self._update(group["kind"], p, hyper[id(group)], exchange)
            if early and writes:  # the verdict, before the first write
                ok, early = self.guard.check(), False
            for dst, new in writes:
                guard.write(dst, new, ok)
        if early:  # no update here: the verdict still counts the step
            ok = self.guard.check()
        sched.step_gather_until(None)
        if exchange is not None:
            exchange.finish()
        if self.config.qk_clip_heads:
            self._qk_clip(ok)
        self.st.publish(self.replicate_async)
        self.guard.forget()
        return loss

    def _update(self, kind: str, p: Tensor, group: dict, exchange) -> list[tuple[Tensor, Tensor]]:
        """`p`'s update where this rank makes it: (destination, new value) pairs, which the
        step writes masked by the guard's verdict (none: not updated here)."""
        if not steps_here(self.st, p):
            return []
        e = self.st.entry(p)
        if e is not None:
            e.wait_publish()  # the last publish may still read this tensor
        adjust = self.config.adjust_lr
        if kind == "muon" and _exchanged(e):
            lr, wd, O = group["lr"], group["weight_decay"], exchange.result(e)
            new = muon_apply(p, O, lr=lr, weight_decay=wd, adjust_lr=adjust, shape=e.full_shape)
            return [(p, new)]
        if kind == "muon" and p.numel() == 0:  # an expert rank that holds no expert
            return []
        # (whole experts: this tensor rank's, as any parameter of several matrices)
        state = {k: fsdp.local(v) for k, v in self.state[p].items()}
        lp, g, pure = fsdp.local(p), fsdp.local(p.grad), state_from(KINDS[kind], state)
        blocks = None if e is None else self.st.plan.blocks_of(e.name)
        team = None if e is None else self.st.team(e)
        kw = {"adjust_lr": adjust, "ns": self.ns, "blocks": blocks, "team": team}
        new, s = param_update(kind, lp, g, pure, group, **kw)
        if kind == "muon" and (team is None or team.orthogonalizes):
            self.ns_calls += 1
            self.ns_blocks += block_count(blocks, team.shape if team else lp.shape)
        return [(lp, new), *((state[k], v) for k, v in state_items(s).items())]

    def _exchange(self, items: list[tuple[dict, Tensor]], ok: Tensor | None) -> TensorExchange:
        """Each tensor-parallel matrix's momentum step (state written, masked by `ok`), then its
        Newton-Schulz once, on its root tensor rank; the caller applies `result(e)`, `finish()`."""
        ex = TensorExchange(self.config.ns)
        index = {id(e): i for i, e in enumerate(self.st.entries)}  # the same on every rank
        for group, p in items:
            e = self.st.entry(p)
            if group["kind"] != "muon" or not _exchanged(e) or not steps_here(self.st, p):
                continue
            s = self.state[p]
            hyper = {k: group[k] for k in ("momentum", "nesterov")}
            u, ms = muon_momentum(p.grad, state_from(MuonState, s), **hyper)
            for k, v in state_items(ms).items():
                guard.write(s[k], v, ok)
            ex.post(e, index[id(e)], u)
        ex.orthogonalize()
        self.ns_calls += ex.ns_calls
        self.ns_blocks += ex.ns_calls  # (one matrix each)
        return ex

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

    whole_state = False  # True while torch's distributed state-dict functions run

    def state_dict(self) -> dict[str, Any]:
        """As torch.optim.Optimizer's: this rank's state (0-size where it does not update).
        Inside torch's `get_optimizer_state_dict` / `get_state_dict`: each dedicated
        parameter's state whole, as a DTensor (collective; dedicated/_optim_state.py)."""
        sd = super().state_dict()
        return whole_state(self, sd) if self.whole_state else sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As torch.optim.Optimizer's, of this rank's `state_dict()` or of whole states (torch's
        distributed state dict: each global owner takes its part), then step counts on the
        parameter's device and the rest in `state_dtype` (the base class casts state to each
        parameter's dtype)."""
        super().load_state_dict(held_state(self, state_dict))
        dtype = self.config.state_dtype
        for p, state in self.state.items():
            for k, v in state.items():
                if k == "step":
                    state[k] = v.to(p.device)
                elif dtype is not None and torch.is_tensor(v) and v.is_floating_point():
                    state[k] = v.to(dtype)

    @torch.no_grad()
    def _qk_clip(self, ok: Tensor | None) -> None:
        """The clip of the attentions' q/k weights this rank updates, from the tracker's max
        logits MAX-reduced over the world (one all-reduce); resets the tracker."""
        cfg, tracker = self.config, self.tracker
        device = self.st.entries[0].param.device
        maxes = stacked_maxes(cfg.qk_clip_heads, tracker.maxima(), device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            with phase("step (QK-clip max logits)"):
                dist.all_reduce(maxes, op=dist.ReduceOp.MAX)
        mine = {n: e for n, e in self.clip_entries.items() if self.st.is_global_owner(e)}
        clip = (cfg.qk_clip_heads, maxes, cfg.qk_clip_tau, cfg.qk_clip_alpha)
        for n, v in clip_params(*clip, {n: e.param for n, e in mine.items()}).items():
            guard.write(mine[n].param, v, ok)
        tracker.reset()

    def wait_publish(self) -> None:
        """Wait for the last backward's reduces and the last step's publishes and gathers."""
        self.st.scheduler.wait_reduces()
        for flight in self.st.scheduler.forward.ahead.values():
            flight.wait()
        for e in self.st.entries:
            e.wait_publish()


def _ready(model: nn.Module, gather_in_step: bool) -> DedicatedState:
    """`model`'s dedicated state, checked for a `Muon` (dedicated, off the meta device, a 1-D
    mesh and prefetch for gather_in_step), its replicas' copies made equal."""
    st = dedicated_state(model)
    if st is None:
        raise ValueError(
            "Muon(model) needs dedicate_params(model, mesh, predicate) first: it decides "
            "which rank owns each matrix. Call dedicate_params, then fully_shard, then Muon"
        )
    if st.on_meta():
        raise ValueError(
            "Muon(model): the dedicated parameters are still on the meta device. Give them "
            "storage and values first: model.to_empty(device=...), then the model's init "
            "(dmuon_fn.init_weights(model, fn, seed=...) for values independent of the "
            "world size), then Muon"
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
    st.sync_copies("Muon")  # a meta model's copies, now that it is initialized
    return st


def _heavy_first(st: DedicatedState, group: dict, p: Tensor) -> tuple[bool, int]:
    """A sort key, the same on every rank (proofs/guard.md 2b): Muon's matrices before the
    elementwise parameters, each by its whole parameter's size, largest first."""
    e = st.entry(p)
    return group["kind"] != "muon", -math.prod(e.full_shape if e is not None else p.shape)


def _clip_entries(st: DedicatedState, config: Config) -> dict[str, Any]:
    """The dedicated entry of each QK-clip weight (`check_clip_heads` against the dedicated
    matrices); ValueError for one split by tensor parallelism."""
    by_name = {n: e for e in st.entries if e.is_matrix for n in e.names}
    shapes = {n: e.full_shape for n, e in by_name.items()}
    check_clip_heads(config.qk_clip_heads, shapes, st.plan.teams)
    names = sorted({n for _, h in config.qk_clip_heads for n in (h.q, h.k)})
    split = [n for n in names if by_name[n].tp is not None]
    if split:
        raise ValueError(
            f"qk_clip_heads names {split[:3]}, split by tensor parallelism: QK-clip runs on "
            "whole dedicated matrices"
        )
    return {n: by_name[n] for n in names}
