"""Muon: the stateful shell over the pure updates, for models prepared by `dedicate_params`.

Param groups (usable with torch.optim.lr_scheduler):
- "muon": dedicated matrices. Only the global owner of a matrix updates it (momentum,
  Newton-Schulz, decoupled weight decay); its gradient arrived reduced during backward, so a
  1-D mesh needs no collective here. Under HSDP the new values are published to the other
  replicas at the end of `step()` (in the background with `replicate_async`). Under tensor
  parallelism every tensor rank of the owner updates its part, and the one exchange the design
  needs, each matrix's Newton-Schulz input gathered to one of them and the result's parts sent
  back, runs first (dmuon_fn/tp/_exchange.py).
- "adamw": everything else: FSDP2 shards (DTensor, updated shard-locally), dedicated
  non-matrices (pure routing, updated by their owner), and plain parameters on a world of one.
Every rank holds a state entry with the same keys for every parameter (0-size placeholders where
it does not own the parameter), so `state_dict()` has identical key sets on all ranks. The state
is per rank: save and load every rank's `state_dict()` (not rank 0's alone).

With `gather_in_step=True` (1-D meshes, prefetch >= 1) the step also issues the next
forward's gathers (Z2: every unit of the recorded module order; Z3: the first `prefetch`), each
unit's as soon as this rank has updated its own parameters of it, so they travel while the
rest of the step computes instead of at the start of the forward. The contract: dedicated
parameters do not change between `step()` and the next forward (the values are already sent);
`dmuon_fn.load_checkpoint` drops the gathers first, and an owner that sees its parameter
changed raises at the next forward instead of computing with the other ranks' stale copies.
Memory: Z2 holds from the step on the gathered copies its forward holds anyway. The model's
forward must run eagerly at the root (compiled blocks are fine): a compiled root records no
module order, and the gathers issued in the step are then dropped unused.

Each step first takes the global gradient norm (one all-reduce, `_guard`): with
`max_grad_norm` the gradients are clipped by it; with nonfinite="skip" (default) a non-finite
gradient anywhere leaves every parameter and all optimizer state untouched on every rank (the
writes are masked on device, no host sync); "raise" raises instead (one host sync);
"ignore" takes no norm and runs no collective.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from ..ns._dispatch import setup_field
from ..ns._orthogonalize import NSConfig
from ..optim import _guard as guard
from ..optim._update import (
    AdamWState,
    MuonState,
    adamw_init,
    adamw_update,
    muon_apply,
    muon_init,
    muon_momentum,
    muon_update,
    state_from,
    state_items,
)
from ..planning._check import check_setup_consistent, kernel_field
from ..tp._exchange import TensorExchange
from . import _fsdp_adapter as fsdp
from ._state import DedicatedState, dedicated_state


class Muon(torch.optim.Optimizer):
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
        for name, value in (
            ("lr", lr),
            ("adamw_lr", adamw_lr),
            ("momentum", momentum),
            ("weight_decay", weight_decay),
            ("adamw_eps", adamw_eps),
            ("adamw_weight_decay", adamw_weight_decay),
        ):
            if not value >= 0.0:
                raise ValueError(f"{name} must be >= 0, got {value!r}")
        if not all(0.0 <= b < 1.0 for b in adamw_betas):
            raise ValueError(f"adamw_betas must lie in [0, 1), got {adamw_betas!r}")
        guard.check_max_norm(max_grad_norm)
        guard.check_nonfinite_mode(nonfinite)
        self.ns = NSConfig(
            steps=ns_steps,
            coefficients=coefficients
            if isinstance(coefficients, str)
            else tuple(tuple(r) for r in coefficients),
            method=ns_method,
            kernel=ns_kernel,
            dtype=ns_dtype,
        )
        self.st: DedicatedState = st
        self.replicate_async = replicate_async
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
        self.gather_in_step = bool(gather_in_step)
        self.adjust_lr = adjust_lr
        self.state_dtype = state_dtype
        self.max_grad_norm = max_grad_norm
        self.nonfinite = nonfinite
        device = st.entries[0].param.device
        # last step's global gradient norm (before clipping) and the count of skipped steps:
        # device tensors, read them when logging (reading syncs)
        self.skipped_steps, self.grad_norm = guard.counters(device)
        self._sq: torch.Tensor | None = None  # this step's Σ‖g‖², once taken
        self._clipped = False
        self.ns_calls = 0  # Newton-Schulz runs on this rank, for tests and benchmarks
        self._index = {id(e): i for i, e in enumerate(st.entries)}  # the same on every rank
        self._exchange: TensorExchange | None = None
        self._names = {id(p): n for n, p in model.named_parameters()}
        self._tensor_copies = _tensor_copies(model, st)
        muon, adamw = [], []
        for p in model.parameters():
            e = st.entry(p)
            (muon if e is not None and e.is_matrix else adamw).append(p)
        if dist.is_initialized() and dist.get_world_size() > 1:
            # a DTensor that fully_shard does not manage is tensor-parallel: fine where the data
            # mesh has one rank, never synchronized over a larger one
            managed, data_parallel = fsdp.managed_params(model), st.shard_size * st.replicate_size
            loose = [
                self._names[id(p)]
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
        groups = [
            dict(
                params=muon,
                kind="muon",
                lr=lr,
                momentum=momentum,
                weight_decay=weight_decay,
                nesterov=nesterov,
            ),
            dict(
                params=adamw,
                kind="adamw",
                lr=adamw_lr,
                betas=tuple(adamw_betas),
                eps=adamw_eps,
                weight_decay=adamw_weight_decay,
            ),
        ]
        super().__init__([g for g in groups if g["params"]], {})
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p] = self._init_state(group["kind"], p)
        kernel, error = kernel_field(self.ns.kernel, device)
        check_setup_consistent(
            {
                "NS kernel": kernel,
                "NS dispatch": setup_field(device),
                "NS config": repr(self.ns),
                "optimizer": repr((adjust_lr, state_dtype, max_grad_norm, nonfinite)),
                "param groups": repr([(g["kind"], len(g["params"])) for g in self.param_groups]),
            }
        )
        if error is not None:
            raise error

    def _updates_here(self, p: torch.Tensor) -> bool:
        e = self.st.entry(p)
        return e is None or self.st.is_global_owner(e)

    def _init_state(self, kind: str, p: torch.Tensor) -> dict[str, Any]:
        """Zero state in `state_dtype` (0-size where this rank does not update `p`); the step
        count lives on the parameter's device, so a masked (skipped) step never syncs."""
        dt = self.state_dtype or p.dtype
        like = p if self._updates_here(p) else torch.empty(0, dtype=dt, device=p.device)
        init = muon_init if kind == "muon" else adamw_init
        return state_items(init(like, dtype=dt))

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        sched = self.st.scheduler
        sched.wait_reduces()
        ok = self._check_grads()
        hyper = {
            id(g): (
                torch.tensor(g["lr"], dtype=torch.float32),
                torch.tensor(g["weight_decay"], dtype=torch.float32),
            )
            for g in self.param_groups
        }
        items = [(g, p) for g in self.param_groups for p in g["params"]]
        keep_all = not self.st.reshard_after_forward
        count, first = sched.gather_in_step_plan(keep_all) if self.gather_in_step else (0, {})
        # with gather_in_step, every unit's parameters are updated before its gather is issued
        # (unit by unit in the recorded order, the rest first); otherwise the order is the
        # param groups': the updates are independent, so the results are the same either way
        entry = self.st.entry
        items.sort(key=lambda it: first.get(id(entry(it[1])), -1))  # stable
        # tensor parallelism: every matrix's Newton-Schulz first, each on its root tensor rank
        self._exchange = self._orthogonalize_split(items, ok) if self.st.tensor else None
        issued = 0
        for group, p in items:
            at = first.get(id(entry(p)), -1)
            while issued < at:
                sched.gather_for_next_forward(issued)
                issued += 1
            self._update(group, p, *hyper[id(group)], ok)
        while issued < count:
            sched.gather_for_next_forward(issued)
            issued += 1
        if self._exchange is not None:
            self._exchange.finish()
            self._exchange = None
        self.st.publish(self.replicate_async)
        self._sq, self._clipped = None, False
        return loss

    def _steps(self, p: torch.Tensor) -> bool:
        """Whether this step updates `p` on this rank."""
        if p.grad is None or not self._updates_here(p):
            return False
        e = self.st.entry(p)
        # a dedicated parameter no gradient reached this step (a stale grad kept by
        # zero_grad(set_to_none=False)) is skipped on every rank alike, as the publish does, so
        # replicas never drift apart
        return e is None or e.touched

    def _orthogonalize_split(self, items, ok) -> TensorExchange:
        """Tensor parallelism: each dedicated matrix's momentum on every tensor rank of its
        owner slot, then its Newton-Schulz once, on its root (dmuon_fn/tp/_exchange.py)."""
        ex = TensorExchange(self.ns)
        for group, p in items:
            e = self.st.entry(p)
            if group["kind"] != "muon" or e is None or e.tp is None or not self._steps(p):
                continue
            state = self.state[p]
            u, ms = muon_momentum(
                p.grad,
                state_from(MuonState, state),
                momentum=group["momentum"],
                nesterov=group["nesterov"],
            )
            for k, v in state_items(ms).items():
                _write(state[k], v, ok)
            ex.post(e, self._index[id(e)], u)
        ex.orthogonalize()
        self.ns_calls += ex.ns_calls
        return ex

    def _update(self, group, p, lr, wd, ok) -> None:
        """One parameter's update, where this rank makes it (a no-op elsewhere)."""
        if not self._steps(p):
            return
        e = self.st.entry(p)
        if e is not None:
            self.st.wait_publish(e)  # the last publish may still read this tensor
        state = self.state[p]
        if group["kind"] == "muon" and e.tp is not None:  # orthogonalized in the exchange
            O = self._exchange.result(e)
            new = muon_apply(
                p, O, lr=lr, weight_decay=wd, adjust_lr=self.adjust_lr, shape=e.full_shape
            )
            _write(p, new, ok)
        elif group["kind"] == "muon":
            new, ms = muon_update(
                p,
                p.grad,
                state_from(MuonState, state),
                lr=lr,
                weight_decay=wd,
                momentum=group["momentum"],
                nesterov=group["nesterov"],
                adjust_lr=self.adjust_lr,
                ns=self.ns,
            )
            self.ns_calls += 1
            _write(p, new, ok)
            for k, v in state_items(ms).items():
                _write(state[k], v, ok)
        else:
            lp, lg = fsdp.local(p), fsdp.local(p.grad)
            m, v = fsdp.local(state["exp_avg"]), fsdp.local(state["exp_avg_sq"])
            new, a = adamw_update(
                lp,
                lg,
                AdamWState(state["step"], m, v),
                lr=lr,
                betas=group["betas"],
                eps=group["eps"],
                weight_decay=wd,
            )
            _write(lp, new, ok)
            _write(m, a.exp_avg, ok)
            _write(v, a.exp_avg_sq, ok)
            _write(state["step"], a.step, ok)

    def _held_grads(self) -> list[tuple[str, torch.Tensor, bool]]:
        """(name, local gradient, counts in the job-wide sum) for every gradient this rank
        will apply; one copy of each value counts (see `_guard`)."""
        out = []
        for group in self.param_groups:
            for p in group["params"]:
                if not self._steps(p):
                    continue  # (a stale gradient: step() skips it, so does the norm)
                # the tensor ranks' equal copies count once, on tensor rank 0
                copy = id(p) in self._tensor_copies and self.st.tensor.rank != 0
                counted = fsdp.counted_here(p.grad) and not copy
                out.append((self._names[id(p)], fsdp.local(p.grad), counted))
        return out

    def _global_sq(self) -> torch.Tensor:
        """[Σ‖g‖² counting each value once, Σ‖g‖² over every local copy] over the job: the
        first is the norm; the second is non-finite whenever any rank's copy is. Taken once per
        step: `clip_grad_norm_` takes it afresh, `zero_grad` and `step` forget it."""
        if self._sq is None:
            held = self._held_grads()
            sq = guard.squared_norms([g for _, g, _ in held], self.grad_norm.device)
            once = [s for s, (_, _, counted) in zip(sq, held, strict=True) if counted]
            both = torch.stack([guard.total(once, sq.device), sq.sum()])
            self._sq = guard.all_reduce_sum(both, "step (global gradient norm)")
        return self._sq

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale every gradient by min(1, max_norm / ‖all gradients‖) (one all-reduce, stays
        on device) and return the total norm before clipping (float32, 0-d). Equals
        torch.nn.utils.clip_grad_norm_ over the unsharded model's gradients. A following
        `step()` reuses this norm and does not clip again."""
        guard.check_max_norm(max_norm)
        self.st.scheduler.wait_reduces()
        self._sq = None  # the gradients may have changed since any earlier norm
        total = self._clip(max_norm)
        self._clipped = True
        return total.float()

    def _clip(self, max_norm: float) -> torch.Tensor:
        total = self._global_sq()[0].sqrt()
        coef = guard.clip_coefficient(total, max_norm)
        for _, g, _ in self._held_grads():
            g.mul_(coef.to(g.device, g.dtype))
        return total

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.st.scheduler.wait_reduces()  # else they would land after the zeroing
        super().zero_grad(set_to_none)
        self._sq, self._clipped = None, False
        for e in self.st.entries:  # a parameter (un)frozen since: compiled blocks see it now
            e.follow_requires_grad()

    def _check_grads(self) -> torch.Tensor | None:
        """The step's gradient guard: decide skip/raise from the unclipped gradients, then clip,
        record the norm, and return the on-device "gradients are finite" flag that masks every
        write (None: nonfinite="ignore")."""
        if self.nonfinite == "ignore" and self.max_grad_norm is None:
            return None
        once, every = self._global_sq()
        self.grad_norm.copy_(once.sqrt())
        ok = None if self.nonfinite == "ignore" else torch.isfinite(every)
        if self.nonfinite == "raise" and not bool(ok):
            bad = [n for n, g, _ in self._held_grads() if not g.isfinite().all()]
            self._sq, self._clipped = None, False
            raise FloatingPointError(
                f"non-finite gradient (global Σ‖g‖² = {every.item()}); on this rank: "
                f"{bad or 'none (it is on another rank)'}. No parameter or state was changed"
            )
        if self.max_grad_norm is not None and not self._clipped:
            self._clip(self.max_grad_norm)
        if ok is not None:
            self.skipped_steps.add_((~ok).to(torch.int64))
        return ok

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As torch.optim.Optimizer's, then step counts back on the parameter's device and the
        rest back to `state_dtype` (the base class casts state to each parameter's dtype, which
        would silently turn fp32 moments of bf16 params bf16)."""
        super().load_state_dict(state_dict)
        for p, state in self.state.items():
            for k, v in state.items():
                if k == "step":
                    state[k] = v.to(p.device)
                elif self.state_dtype is not None and torch.is_tensor(v) and v.is_floating_point():
                    state[k] = v.to(self.state_dtype)

    def wait_publish(self) -> None:
        """Block until every background publish of the last step (with gather_in_step: the next
        forward's gathers it issued), and every gradient reduce of the last backward, has
        landed."""
        self.st.scheduler.wait_reduces()
        self.st.scheduler.wait_ahead()
        for e in self.st.entries:
            self.st.wait_publish(e)


def _tensor_copies(model: nn.Module, st: DedicatedState) -> set[int]:
    """ids of the parameters every tensor-parallel rank holds an equal copy of: dedicated ones
    tensor parallelism does not split, and the others whose mesh (if any) has none of the other
    tensor ranks (e.g. an FSDP2 shard over the data mesh alone). Empty without tensor
    parallelism."""
    tp = st.tensor
    if tp is None or tp.size == 1:
        return set()
    peers = set(tp.mesh.mesh.flatten().tolist()) - {dist.get_rank()}
    out = set()
    for p in model.parameters():
        e = st.entry(p)
        if (e is not None and not e.tp.sharded) or (e is None and not fsdp.mesh_ranks(p) & peers):
            out.add(id(p))
    return out


def _write(dst: torch.Tensor, new: torch.Tensor, ok: torch.Tensor | None) -> None:
    """dst ← new, or left as it is where the step is skipped (`ok` False), without a sync."""
    dst.copy_(new if ok is None else torch.where(ok.to(dst.device), new, dst))
