"""Backward's gradient sums and their reduces onto the global owners (object API).

Per bucket (a module's `_units.Group`) the gradients of this forward's handed-out values are
summed in one flat buffer of the reduce dtype, reduced onto the local owner over the shard group
once complete (at the next call) or when the pass ends, and landed by `wait` as the mean over the
G·R data ranks in the global owners' `.grad` (HSDP: after a second stage across replicas). With
sync off the sums stay on each rank (proofs/dedicated_notes.md, proofs/prefetch.md claim 4).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from custom_ops._collectives import reduce_start

from ..comm._counters import blocked
from ..comm._errors import phase
from ._entries import Entry, Topology, wait_work
from ._units import Group


@dataclass(eq=False)
class _Reduce:
    group: Group
    flat: Tensor
    work: object
    members: tuple[int, ...]  # indices into group.entries, in flat order
    stage2: object = None


class Reducer:
    """A model's gradient buckets and the reduces in flight; `depth` 0: every reduce is issued
    and landed at once."""

    def __init__(self, topo: Topology, buckets: Sequence[Group], depth: int) -> None:
        self.topo, self.buckets, self.depth = topo, list(buckets), depth
        self.sync = True  # gradient sync (False: accumulate locally)
        self.reduces: list[_Reduce] = []
        self.ready: list[Group] = []  # complete gradient sums, reduced at the next call

    def expect(self, g: Group, e: Entry) -> None:
        g.owed[g.index[id(e)]] += 1

    def forget_owed(self) -> None:
        for g in self.buckets:
            g.owed = [0] * len(g.entries)

    def deposit(self, g: Group, e: Entry, grad: Tensor) -> None:
        """Add the gradient (shape `e.shape`) of one handed-out value of `e` into bucket `g`."""
        self.flush()
        i = g.index[id(e)]
        if g.flat is None:
            g.flat = torch.empty(g.numel, dtype=g.reduce_dtype, device=g.device)
        part = g.part(g.flat, i)
        if g.has[i]:
            part.add_(grad)
        else:
            part.copy_(grad)
            g.has[i] = True
        g.owed[i] = max(0, g.owed[i] - 1)
        if self.sync and not any(g.owed):
            self.ready.append(g)
            if not self.depth:
                self.flush()

    def flush(self) -> None:
        """Reduce the sums made complete since the last call."""
        ready, self.ready = self.ready, []
        for g in ready:
            self._reduce(g)

    def end_pass(self) -> None:
        """Reduce every sum (sync on), complete or not."""
        self.flush()
        self.forget_owed()
        if self.sync:
            for g in self.buckets:
                self._reduce(g)

    def _reduce(self, g: Group) -> None:
        """Issue the reduce of the bucket's sum (zeros for entries it holds no gradient of)."""
        flat, members = g.flat, tuple(i for i, h in enumerate(g.has) if h)
        g.flat, g.has = None, [False] * len(g.entries)
        if flat is None:
            return
        for i in range(len(g.entries)):
            if i not in members:
                g.part(flat, i).zero_()
        work = None
        if self.topo.shard_size > 1:
            with phase(f"backward (gradient reduce of {g.names})"):
                work = reduce_start(flat, g.owner, self.topo.shard_group)
        self.reduces.append(_Reduce(g, flat, work, members))
        if not self.depth:
            self.wait()

    def wait(self) -> None:
        """Land every issued reduce (HSDP: stage 2 issued here, in issue order)."""
        self.flush()
        topo, pending, self.reduces = self.topo, self.reduces, []
        for r in pending:
            with blocked(), phase(f"backward (gradient reduce of {r.group.names})"):
                if r.work is not None:
                    r.work.wait()
                if topo.replicate_group is not None and topo.is_local_owner(r.group.entries[0]):
                    r.stage2 = reduce_start(r.flat, r.group.owner_replica, topo.replicate_group)
        for r in pending:
            if r.stage2 is not None:
                wait_work(r.stage2, f"backward (gradient reduce of {r.group.names})")
            self._land(r)

    def _land(self, r: _Reduce) -> None:
        """The mean (sum / (G·R)) into each global owner's `.grad`."""
        g, topo = r.group, self.topo
        scale = topo.shard_size * topo.replicate_size
        for i in r.members:
            e = g.entries[i]
            if topo.is_global_owner(e) and e.param.requires_grad:
                grad = g.part(r.flat, i).to(e.param.dtype).div_(scale)
                with torch.no_grad():  # what autograd's AccumulateGrad does
                    if e.param.grad is None:
                        e.param.grad = grad
                    else:
                        e.param.grad += grad
