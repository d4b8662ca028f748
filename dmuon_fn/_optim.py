"""Muon: the stateful shell over the pure updates, for models prepared by `dedicate_params`.

Param groups (usable with torch.optim.lr_scheduler):
- "muon": dedicated matrices. Only the global owner of a matrix updates it (momentum,
  Newton-Schulz, decoupled weight decay); its gradient arrived reduced during backward, so a
  1-D mesh needs no collective here. Under HSDP the new values are published to the other
  replicas at the end of `step()` (in the background with `replicate_async`).
- "adamw": everything else: FSDP2 shards (DTensor, updated shard-locally), dedicated
  non-matrices (pure routing, updated by their owner), and plain parameters on a world of one.
Every rank holds a state entry with the same keys for every parameter (0-size placeholders where
it does not own the parameter), so `state_dict()` has identical key sets on all ranks. The state
is per rank: save and load every rank's `state_dict()` (not rank 0's alone).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from . import _fsdp_adapter as fsdp
from ._dedicate import DedicatedState, dedicated_state
from ._orthogonalize import NSConfig
from ._update import AdamWState, MuonState, adamw_update, muon_update


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
        self.adjust_lr = adjust_lr
        self.state_dtype = state_dtype
        self.ns_calls = 0  # Newton-Schulz runs on this rank, for tests and benchmarks
        self._names = {id(p): n for n, p in model.named_parameters()}
        muon, adamw = [], []
        for p in model.parameters():
            e = st.entry(p)
            (muon if e is not None and e.is_matrix else adamw).append(p)
        if dist.is_initialized() and dist.get_world_size() > 1:
            loose = [
                self._names[id(p)] for p in adamw if st.entry(p) is None and not fsdp.is_dtensor(p)
            ]
            if loose:
                raise ValueError(
                    f"{loose[:3]}{'...' if len(loose) > 3 else ''} are neither dedicated nor "
                    "sharded by fully_shard, so their gradients are never synchronized: call "
                    "fully_shard on the model after dedicate_params, or dedicate_params(..., "
                    "pure=True)"
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

    def _updates_here(self, p: torch.Tensor) -> bool:
        e = self.st.entry(p)
        return e is None or self.st.is_global_owner(e)

    def _init_state(self, kind: str, p: torch.Tensor) -> dict[str, Any]:
        dt = self.state_dtype or p.dtype
        if not self._updates_here(p):
            empty = torch.empty(0, dtype=dt, device=p.device)
            if kind == "muon":
                return {"momentum_buffer": empty}
            return {
                "step": torch.zeros((), dtype=torch.float32),
                "exp_avg": empty,
                "exp_avg_sq": empty.clone(),
            }
        if kind == "muon":
            return {"momentum_buffer": torch.zeros_like(p, dtype=dt)}
        return {
            "step": torch.zeros((), dtype=torch.float32),
            "exp_avg": torch.zeros_like(p, dtype=dt),
            "exp_avg_sq": torch.zeros_like(p, dtype=dt),
        }

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr = torch.tensor(group["lr"], dtype=torch.float32)
            wd = torch.tensor(group["weight_decay"], dtype=torch.float32)
            for p in group["params"]:
                e = self.st.entry(p)
                if p.grad is None or not self._updates_here(p):
                    continue
                if e is not None:
                    if not e.touched:
                        # no gradient reached it this step (a stale grad kept by
                        # zero_grad(set_to_none=False)): skip it on every rank alike, as the
                        # publish does, so replicas never drift apart
                        continue
                    self.st.wait_publish(e)  # the last publish may still read this tensor
                state = self.state[p]
                if group["kind"] == "muon":
                    new, ms = muon_update(
                        p,
                        p.grad,
                        MuonState(state["momentum_buffer"]),
                        lr=lr,
                        weight_decay=wd,
                        momentum=group["momentum"],
                        nesterov=group["nesterov"],
                        adjust_lr=self.adjust_lr,
                        ns=self.ns,
                    )
                    self.ns_calls += 1
                    p.copy_(new)
                    state["momentum_buffer"].copy_(ms.momentum)
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
                    lp.copy_(new)
                    m.copy_(a.exp_avg)
                    v.copy_(a.exp_avg_sq)
                    state["step"].copy_(a.step)
        self.st.publish(self.replicate_async)
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As torch.optim.Optimizer's, then back to `state_dtype` (the base class casts state
        to each parameter's dtype, which would silently turn fp32 moments of bf16 params bf16)."""
        super().load_state_dict(state_dict)
        if self.state_dtype is None:
            return
        for state in self.state.values():
            for k, v in state.items():
                if k != "step" and torch.is_tensor(v) and v.is_floating_point():
                    state[k] = v.to(self.state_dtype)

    def wait_publish(self) -> None:
        """Block until every background publish of the last step has landed."""
        for e in self.st.entries:
            self.st.wait_publish(e)
