"""`Muon.step()` beyond the per-parameter update: the gradient guard over the gradients this rank
applies, the next forward's gathers (`gather_in_step`), and the tensor-parallel exchange
(proofs/step_notes.md, proofs/guard.md)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from ..comm._errors import phase
from ..optim import _guard as guard
from ..optim._config import Config
from ..optim._update import MuonState, muon_momentum, state_from, state_items
from ..tp._transfer import TensorExchange
from . import _fsdp_adapter as fsdp
from ._state import DedicatedState

Item = tuple[dict[str, Any], torch.Tensor]  # (param group, parameter)


def updates_here(st: DedicatedState, p: torch.Tensor) -> bool:
    """Whether this rank updates `p`: a dedicated parameter's global owner; any rank otherwise."""
    e = st.entry(p)
    return e is None or st.is_global_owner(e)


def steps_here(st: DedicatedState, p: torch.Tensor) -> bool:
    """Whether this step updates `p` here. A dedicated parameter no gradient reached (a stale
    grad kept by zero_grad(set_to_none=False)) is skipped on every rank, as by the publish."""
    if p.grad is None or not updates_here(st, p):
        return False
    e = st.entry(p)
    return e is None or e.touched


class GradGuard:
    """The guard over the gradients this rank applies: the job's Σ‖g‖² (one all-reduce per
    step), clip, skip/raise, and the counters `skipped_steps` (int64) and `grad_norm` (float32,
    the last norm before clipping), 0-d on device."""

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
        """(name, local gradient, counted once in the job's sum) per gradient this rank applies."""
        out = []
        for group in self.groups:
            for p in group["params"]:
                if not steps_here(self.st, p):
                    continue
                # the tensor ranks' equal copies count once, on tensor rank 0
                copy = id(p) in self.copies and self.st.tensor.rank != 0
                counted = fsdp.counted_here(p.grad) and not copy
                out.append((self.names[id(p)], fsdp.local(p.grad), counted))
        return out

    def global_sq(self) -> torch.Tensor:
        """The job's [Σ‖g‖² counting each value once, Σ‖g‖² over every copy], float64."""
        if self._sq is None:
            held = self.held()
            sq = guard.squared_norms([g for _, g, _ in held], self.grad_norm.device)
            # a sum of 0-d tensors: a host-built index or mask would be a blocking copy on CUDA
            once = [s for s, (_, _, counted) in zip(sq, held, strict=True) if counted]
            once = torch.stack(once).sum() if once else sq.new_zeros(())
            self._sq = torch.stack([once, sq.sum()])
            if dist.is_initialized() and dist.get_world_size() > 1:
                with phase("step (global gradient norm)"):
                    dist.all_reduce(self._sq, op=dist.ReduceOp.SUM)
        return self._sq

    def clip(self, max_norm: float) -> torch.Tensor:
        """Scale every held gradient by min(1, max_norm / ‖g‖); returns ‖g‖ (float32, 0-d)."""
        self._sq = None  # the gradients may have changed since
        total = self.global_sq()[0].sqrt()
        self._scale(guard.clip_coefficient(total, max_norm))
        self.clipped = True
        return total.float()

    def _scale(self, coef: torch.Tensor) -> None:
        for _, g, _ in self.held():
            g.mul_(coef.to(g.device, g.dtype))

    def check(self) -> torch.Tensor | None:
        """Record the norm, raise (nonfinite="raise"), clip (unless `clip` did), count a skip;
        returns the on-device finite flag that masks every write (None: unmasked)."""
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
    """ids of the parameters every tensor rank holds an equal copy of: dedicated ones TP does not
    split, and others whose mesh (if any) has no other tensor rank (an FSDP2 shard over the
    data mesh alone)."""
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
    """The next forward's gathers issued from the step (`gather_in_step`; else none): each
    recorded unit's once this rank has updated its own parameters of it."""

    def __init__(self, st: DedicatedState, enabled: bool) -> None:
        self.sched, self.entry, self.issued = st.scheduler, st.entry, 0
        keep_all = not st.reshard_after_forward
        self.count, self.first = self.sched.next_forward_order(keep_all) if enabled else (0, {})

    def unit(self, p: torch.Tensor) -> int:
        """The first unit whose gather must wait for `p`'s update (-1: none)."""
        return self.first.get(id(self.entry(p)), -1)

    def issue_before(self, p: torch.Tensor | None) -> None:
        """Issue the gathers of every unit before `p`'s (None: all the rest); call it before each
        update, in `unit` order, then with None."""
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
    (state written, masked by `ok`), then its Newton-Schulz once, on its root tensor rank. The
    caller applies `result(e)` and calls `finish()`."""
    ex = TensorExchange(config.ns)
    index = {id(e): i for i, e in enumerate(st.entries)}  # the same on every rank
    for group, p in items:
        e = st.entry(p)
        if group["kind"] != "muon" or e is None or e.tp is None or not steps_here(st, p):
            continue
        s = state[p]
        hyper = {k: group[k] for k in ("momentum", "nesterov")}
        u, ms = muon_momentum(p.grad, state_from(MuonState, s), **hyper)
        for k, v in state_items(ms).items():
            guard.write(s[k], v, ok)
        ex.post(e, index[id(e)], u)
    ex.orthogonalize()
    return ex
