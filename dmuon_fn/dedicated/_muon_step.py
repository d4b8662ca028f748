"""The parts of `Muon.step()` beyond the per-parameter update: the gradient guard over the
gradients this rank applies, the next forward's gathers issued from the step
(`gather_in_step`), and the tensor-parallel exchange that orthogonalizes split matrices."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from ..optim import _guard as guard
from ..optim._config import Config
from ..optim._update import MuonState, muon_momentum, state_from, state_items
from ..tp._transfer import TensorExchange
from . import _fsdp_adapter as fsdp
from ._state import DedicatedState

Item = tuple[dict[str, Any], torch.Tensor]  # (param group, parameter)


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


class GradGuard:
    """The step's gradient guard (optim/_guard.py, proofs/guard.md) over the gradients this rank
    applies: the job's Σ‖g‖², taken once per step (one all-reduce), the clip, the skip/raise
    decision and the counters (0-d device tensors: `skipped_steps` int64, `grad_norm` float32,
    the last norm before clipping; reading them syncs)."""

    def __init__(self, model: nn.Module, st: DedicatedState, config: Config, groups: list) -> None:
        self.st, self.config, self.groups = st, config, groups
        self.skipped_steps, self.grad_norm = guard.counters(st.entries[0].param.device)
        self.names = {id(p): n for n, p in model.named_parameters()}
        self.copies = _tensor_copies(model, st)
        self.forget()

    def forget(self) -> None:
        """The gradients may change: take the norm afresh, and clip again, next time."""
        self._sq: torch.Tensor | None = None
        self.clipped = False

    def held(self) -> list[tuple[str, torch.Tensor, bool]]:
        """(name, local gradient, counts in the job-wide sum) for every gradient this rank
        will apply; one copy of each value counts."""
        out = []
        for group in self.groups:
            for p in group["params"]:
                if not steps_here(self.st, p):
                    continue  # (a stale gradient: step() skips it, so does the norm)
                # the tensor ranks' equal copies count once, on tensor rank 0
                copy = id(p) in self.copies and self.st.tensor.rank != 0
                counted = fsdp.counted_here(p.grad) and not copy
                out.append((self.names[id(p)], fsdp.local(p.grad), counted))
        return out

    def global_sq(self) -> torch.Tensor:
        """[Σ‖g‖² counting each value once, Σ‖g‖² over every local copy] over the job: the
        first is the norm; the second is non-finite whenever any rank's copy is."""
        if self._sq is None:
            held = self.held()
            sq = guard.squared_norms([g for _, g, _ in held], self.grad_norm.device)
            once = [s for s, (_, _, counted) in zip(sq, held, strict=True) if counted]
            both = torch.stack([guard.total(once, sq.device), sq.sum()])
            self._sq = guard.all_reduce_sum(both, "step (global gradient norm)")
        return self._sq

    def clip(self, max_norm: float) -> torch.Tensor:
        """Scale every held gradient by min(1, max_norm / ‖g‖); returns ‖g‖ (float32, 0-d)."""
        self._sq = None  # the gradients may have changed since any earlier norm
        total = self.global_sq()[0].sqrt()
        self._scale(guard.clip_coefficient(total, max_norm))
        self.clipped = True
        return total.float()

    def _scale(self, coef: torch.Tensor) -> None:
        for _, g, _ in self.held():
            g.mul_(coef.to(g.device, g.dtype))

    def check(self) -> torch.Tensor | None:
        """The step's decision from the unclipped gradients: record the norm, raise
        (nonfinite="raise"), clip (unless `clip` did), count a skip; returns the on-device
        "gradients are finite" flag that masks every write (None: nothing is masked)."""
        cfg = self.config
        if not cfg.guarded:
            return None
        once, every = self.global_sq()
        v = guard.judge(once, every, cfg.nonfinite, None if self.clipped else cfg.max_grad_norm)
        self.grad_norm.copy_(v.norm)
        if cfg.nonfinite == "raise" and not bool(v.ok):
            bad = [n for n, g, _ in self.held() if not g.isfinite().all()]
            self.forget()
            raise FloatingPointError(
                f"non-finite gradient (global Σ‖g‖² = {every.item()}); on this rank: "
                f"{bad or 'none (it is on another rank)'}. No parameter or state was changed"
            )
        if v.coef is not None:
            self._scale(v.coef)
        self.skipped_steps.copy_(guard.tally(self.skipped_steps, v.ok))
        return v.ok


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


class NextForward:
    """The next forward's gathers, issued from the step (`gather_in_step`): each recorded unit's
    once this rank has updated its own parameters of it. Without it, issues nothing."""

    def __init__(self, st: DedicatedState, enabled: bool) -> None:
        self.sched, self.entry, self.issued = st.scheduler, st.entry, 0
        keep_all = not st.reshard_after_forward
        plan = self.sched.next_forward_order(keep_all) if enabled else (0, {})
        self.count, self.first = plan

    def unit(self, p: torch.Tensor) -> int:
        """The first unit whose gather must wait for `p`'s update (-1: none)."""
        return self.first.get(id(self.entry(p)), -1)

    def issue_before(self, p: torch.Tensor | None) -> None:
        """Issue every unit's gathers before `p`'s unit (None: all the rest). Call it before each
        update, in `unit` order, and once with None at the end."""
        until = self.count if p is None else self.unit(p)
        while self.issued < until:
            self.sched.gather_for_next_forward(self.issued)
            self.issued += 1


def exchange_momenta(
    st: DedicatedState,
    items: Sequence[Item],
    state: dict[torch.Tensor, dict[str, torch.Tensor]],
    config: Config,
    ok: torch.Tensor | None,
) -> TensorExchange:
    """Tensor parallelism: each split matrix's momentum step on every tensor rank of its owner
    slot (state written, masked by `ok`), then its Newton-Schulz once, on its root tensor rank
    (dmuon_fn/tp/_transfer.py). The caller applies `result(e)` and calls `finish()`."""
    ex = TensorExchange(config.ns)
    index = {id(e): i for i, e in enumerate(st.entries)}  # the same on every rank
    for group, p in items:
        e = st.entry(p)
        if group["kind"] != "muon" or e is None or e.tp is None or not steps_here(st, p):
            continue
        s = state[p]
        u, ms = muon_momentum(
            p.grad,
            state_from(MuonState, s),
            momentum=group["momentum"],
            nesterov=group["nesterov"],
        )
        for k, v in state_items(ms).items():
            guard.write(s[k], v, ok)
        ex.post(e, index[id(e)], u)
    ex.orthogonalize()
    return ex
