"""The object face's gradient guard (proofs/guard.md): the job's Σ‖g‖² over the gradients this
rank applies, one all-reduce per step issued as soon as the gradients have landed and waited for
where the step needs its verdict; clip, skip/raise, and `Muon`'s counters."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch import Tensor

from ..comm._mesh import phase
from ..optim import _guard as guard
from ..optim._config import Config
from . import _fsdp_adapter as fsdp
from ._state import DedicatedState


def updates_here(st: DedicatedState, p: Tensor) -> bool:
    """Whether this rank updates `p`: a dedicated parameter's global owner; any rank otherwise."""
    e = st.entry(p)
    return e is None or st.is_global_owner(e)


def steps_here(st: DedicatedState, p: Tensor) -> bool:
    """Whether this step updates `p` here. A dedicated parameter no gradient reached (a stale
    grad kept by zero_grad(set_to_none=False)) is skipped on every rank, as by the publish."""
    e = st.entry(p)
    return p.grad is not None and updates_here(st, p) and (e is None or e.touched)


class GradGuard:
    """The guard over the gradients this rank applies: the job's Σ‖g‖² (one all-reduce per
    step), clip, skip/raise, and `Muon`'s counters (`grad_norm`: the last norm before clipping)."""

    def __init__(self, model: nn.Module, st: DedicatedState, config: Config, groups: list) -> None:
        self.st, self.config, self.groups = st, config, groups
        self.skipped_steps, self.grad_norm = guard.counters(st.entries[0].param.device)
        self.names = {id(p): n for n, p in model.named_parameters()}
        # equal copies on every tensor rank count once, on tensor rank 0: off it, the parameters
        # TP does not split whose mesh (if any) has no other tensor rank (e.g. FSDP2's alone)
        tp, self.copies = st.tensor, set()
        if tp is not None and tp.size > 1 and tp.rank != 0:
            peers = set(tp.mesh.mesh.flatten().tolist()) - {dist.get_rank()}
            ps = [p for p in model.parameters() if (e := st.entry(p)) is None or not e.tp.sharded]
            self.copies = {id(p) for p in ps if not fsdp.mesh_ranks(p) & peers}
        self.forget()

    def forget(self) -> None:  # the gradients may change: a new norm, and clip again, next time
        self._sq: Tensor | None = None
        self._work: dist.Work | None = None  # the all-reduce of _sq, while in flight
        self.clipped = False

    def early(self) -> bool:
        """Whether the step may compute an update before the verdict: guarded, and nothing the
        verdict decides changes an update (no clip coefficient left to apply), only whether it
        is written."""
        cfg = self.config
        return cfg.guarded and (cfg.max_grad_norm is None or self.clipped)

    def held(self) -> list[tuple[str, Tensor, bool]]:
        """(name, local gradient, counted once in the job's sum) per gradient this rank applies."""
        ps = [p for g in self.groups for p in g["params"] if steps_here(self.st, p)]
        once = [fsdp.counted_here(p.grad) and id(p) not in self.copies for p in ps]
        return [(self.names[id(p)], fsdp.local(p.grad), c) for p, c in zip(ps, once, strict=True)]

    def start(self) -> None:
        """Issue the job's Σ‖g‖² all-reduce without waiting for it (`global_sq` waits)."""
        if self._sq is not None:
            return
        held = self.held()
        sq = guard.squared_norms([g for _, g, _ in held], self.grad_norm.device)
        # a sum of 0-d tensors: a host-built index or mask would be a blocking copy on CUDA
        once = [s for s, (_, _, counted) in zip(sq, held, strict=True) if counted]
        once = torch.stack(once).sum() if once else sq.new_zeros(())
        self._sq = torch.stack([once, sq.sum()])
        if dist.is_initialized() and dist.get_world_size() > 1:
            with phase("step (global gradient norm)"):
                self._work = dist.all_reduce(self._sq, op=dist.ReduceOp.SUM, async_op=True)

    def global_sq(self) -> Tensor:
        """The job's [Σ‖g‖² counting each value once, Σ‖g‖² over every copy], float64."""
        self.start()
        if self._work is not None:
            with phase("step (global gradient norm)"):
                self._work.wait()
            self._work = None
        return self._sq

    def clip(self, max_norm: float) -> Tensor:
        """Scale every held gradient by min(1, max_norm / ‖g‖); returns ‖g‖ (float32, 0-d)."""
        self._sq = None  # the gradients may have changed since
        total = self.global_sq()[0].sqrt()
        coef = guard.clip_coefficient(total, max_norm)
        for _, g, _ in self.held():
            g.mul_(coef.to(g.device, g.dtype))
        self.clipped = True
        return total.float()

    def check(self) -> Tensor | None:
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
            for _, g, _ in self.held():
                g.mul_(v.coef.to(g.device, g.dtype))
        self.skipped_steps.copy_(guard.tally(self.skipped_steps, v.ok))
        return v.ok
