"""Prefetched gathers and asynchronous reduces of a model's dedicated parameters: gradients sum
per bucket in the reduce dtype and land in the global owners' `.grad` as the mean over the G·R
data ranks, or the sum divided by the factor FSDP2's `set_gradient_divide_factor` gave the
module that holds the parameter, as FSDP2 divides its own (proofs/prefetch.md,
proofs/dedicated_notes.md)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from custom_ops._collectives import reduce_start

from ..comm._counters import blocked
from ..comm._mesh import phase
from ._state import DedicatedState, Entry, Group, Unit, broadcast_start, wait_work


class Flight:
    """One unit's gathers, issued: per group, the owner's concatenated values (a copy in the
    group's dtype) broadcast over the shard group; `flats[i]` is group i's, final after `wait`."""

    def __init__(self, st: DedicatedState, unit: Unit, what: str) -> None:
        self.unit, self.what, self.flats, self.works = unit, what, [], []
        with torch.profiler.record_function("dmuon::param_gather"):  # a label for profiles
            for g in unit.groups:
                if st.is_local_owner(g.entries[0]):
                    for e in g.entries:
                        e.wait_publish()  # an HSDP publish may still be writing the value
                    # a copy: the step updates the parameter in place
                    flat = torch.cat([e.param.detach().reshape(-1).to(g.dtype) for e in g.entries])
                else:
                    flat = torch.empty(g.numel, dtype=g.dtype, device=g.device)
                self.flats.append(flat)
                name = f"{what} of {g.names}"
                self.works.append(broadcast_start(flat, g.owner, st.shard_group, name))

    def wait(self) -> Flight:
        for i, w in enumerate(self.works):
            if w is not None:
                wait_work(w, f"{self.what} of {self.unit.groups[i].names}")
                self.works[i] = None
        return self

    def value(self, e: Entry) -> Tensor:
        i, g = next((i, g) for i, g in enumerate(self.unit.groups) if id(e) in g.index)
        return g.part(self.flats[i], g.index[id(e)])


class Cursor:
    """A walk through the recorded unit order, forward (`step` 1) or backward (-1: Z3's
    re-gathers), with the next `depth` units' gathers issued ahead (`ahead`: position -> them)."""

    def __init__(self, sched: Scheduler, step: int, what: str) -> None:
        self.issue, self.depth, self.step, self.what = sched.issue, sched.depth, step, what
        self.order: list[Unit] = []
        self.pos = -1  # next expected index into `order`; -1: off the recorded order
        self.ahead: dict[int, Flight] = {}

    def restart(self, order: list[Unit]) -> None:
        self.order = order
        self.pos = (0 if self.step > 0 else len(order) - 1) if order else -1

    def take(self, unit: Unit) -> Flight:
        """`unit`'s gathers: those issued ahead if it is the walk's next unit, else (off the
        order) drain and stop the walk and gather it now; then issue the next `depth` units'."""
        flight = None
        if 0 <= self.pos < len(self.order) and self.order[self.pos] is unit:
            flight = self.ahead.pop(self.pos, None)
            self.pos += self.step
        else:
            self.drain()
            self.pos = -1
        flight = flight or self.issue(unit, self.what)
        self.prefetch()
        return flight

    def prefetch(self) -> None:
        if self.pos < 0:
            return
        end = len(self.order) if self.step > 0 else -1
        for j in range(self.pos, end, self.step)[: self.depth]:
            if j not in self.ahead:
                self.ahead[j] = self.issue(self.order[j], self.what)

    def drain(self) -> None:
        """Wait for (every rank issued them alike) and drop the gathers issued ahead."""
        for pos in sorted(self.ahead):
            self.ahead[pos].wait()
        self.ahead.clear()


class Scheduler:
    """Runs a model's dedicated gathers and reduces. `depth`: units whose gathers are issued
    ahead (0: none, every gather and reduce waited for where it is issued)."""

    def __init__(
        self, st: DedicatedState, units: Sequence[Unit], buckets: Sequence[Group], depth: int
    ) -> None:
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 0:
            raise ValueError(f"prefetch must be an int >= 0 (0: off), got {depth!r}")
        self.st, self.units, self.buckets = st, list(units), list(buckets)
        self.depth = depth
        self.forward = Cursor(self, 1, "forward (parameter gather)")
        self.backward = Cursor(self, -1, "backward (Z3 parameter re-gather)")
        self.order: list[Unit] = []  # the last forward's units, in order
        self.current: list[Unit] = []  # this forward's so far
        self.open: tuple[Unit, Flight] | None = None  # the unit computing, and its gathers
        self.landed: dict[int, Flight] = {}  # Z3 backward: id(unit) -> its re-gathered copy
        # gather_in_step: (entry, param version) sent by this local owner; units to issue, issued
        self.from_step: list[tuple[Entry, int]] | None = None
        self.step_units, self.step_issued = 0, 0
        self.sync = True  # gradient sync (False: accumulate locally)
        self.pass_open = False  # a backward pass has an end-of-pass callback queued
        self.ready: list[Group] = []  # complete gradient sums, reduced at the next call
        self.reduces: list[list] = []  # issued: [bucket, flat sum, work, indices it holds]
        # the bytes of gradient sums in flight before the oldest are landed: as many as Z3's
        # gathered copies (depth + 1 of the largest unit), so no rank holds a whole model's
        sizes = [sum(g.numel * g.reduce_dtype.itemsize for g in u.groups) for u in self.units]
        self.reduce_cap = (depth + 1) * max(sizes, default=0)

    def issue(self, unit: Unit, what: str) -> Flight:
        flight = Flight(self.st, unit, what)
        return flight if self.depth else flight.wait()

    def begin_forward(self) -> None:
        """Land last backward's reduces, forget what an earlier forward left owed, issue the
        first units (keeping those the step issued, unless their owners changed since)."""
        if self.st.unsynced:  # a meta model's first forward
            if self.st.on_meta():
                raise RuntimeError(
                    "forward of a model whose dedicated parameters are on the meta device: "
                    "call model.to_empty(device=...) and initialize the model first"
                )
            self.st.sync_copies("forward")
        self.wait_reduces()
        changed = [e.name for e, v in self.from_step or () if e.param._version != v]
        if self.from_step is None or changed:
            self.forward.drain()
        self.from_step = None
        if changed:
            raise RuntimeError(
                f"{changed[:3]}{'...' if len(changed) > 3 else ''} changed between "
                "optimizer.step() and the next forward, after Muon(gather_in_step=True) had "
                "sent their values to the other ranks, which now hold the old ones. Change "
                "dedicated parameters only before step() (or load them with "
                "dmuon_fn.load_checkpoint), or use gather_in_step=False"
            )
        for unit in self.units:
            unit.owed_regathers = 0
        for g in self.buckets:
            g.owed = [0] * len(g.entries)
        self.open, self.current = None, []
        self.forward.restart(self.order)
        self.forward.prefetch()

    def end_forward(self) -> None:
        self.forward.drain()
        self.forward.restart([])  # off the order until the next forward
        last, self.open = self.open, None
        if self.current:
            self.order, self.current = self.current, []
        self._restart_backward()
        if last and last[0].owed_regathers and self.order and self.order[-1] is last[0]:
            # Z3 backward begins with the last unit: keep its copy (never gathered twice in a
            # row) and issue the units before it now, overlapping the loss and what follows
            self.landed[id(last[0])] = last[1]
            self.backward.restart(self.order[:-1])
            self.backward.prefetch()

    def value(self, e: Entry, unit: Unit, bucket: Group | None) -> Tensor:
        """`e`'s full value for a module of `unit`; `bucket`: its gradient is owed there."""
        flight = self.open_unit(unit).wait()
        if bucket is not None:
            bucket.owed[bucket.index[id(e)]] += 1
        return flight.value(e)

    def open_unit(self, unit: Unit) -> Flight:
        """`unit` is about to run: its gathers, issued (or taken from those issued ahead)."""
        if self.open is None or self.open[0] is not unit:
            self.open = None  # the last unit's copy goes before the next one is gathered
            self.current.append(unit)
            if len(self.current) > 4 * len(self.units) + 4:
                del self.current[: len(self.units)]  # no end_forward: the root is never called
            self.open = (unit, self.forward.take(unit))
        return self.open[1]

    def step_gathers(self, enabled: bool) -> dict[int, int]:
        """gather_in_step: the step gathers the recorded order's first units (all under Z2, else
        `depth`) for the next forward; returns id(param) -> the first of them holding it."""
        order = self.order[: self.depth] if self.st.reshard_after_forward else self.order
        units = list(enumerate(order if enabled else ()))
        self.step_units, self.step_issued = len(units), 0
        # in reverse, so the first unit holding an entry is the one kept
        return {id(e.param): j for j, u in reversed(units) for g in u.groups for e in g.entries}

    def step_gather_until(self, j: int | None) -> None:
        """Issue the step's gathers of the recorded units before `j` (None: all of them), once
        this rank updated its parameters of each. Every rank calls it in increasing `j`."""
        while self.step_issued < (self.step_units if j is None else j):
            k = self.step_issued
            if k == 0:
                self.drop_ahead()
                self.from_step = []
            unit = self.order[k]
            self.forward.ahead[k] = self.issue(unit, "step (the next forward's parameter gather)")
            for g in unit.groups:
                if self.st.is_local_owner(g.entries[0]):
                    self.from_step += [(e, e.param._version) for e in g.entries]
            self.step_issued += 1

    def drop_ahead(self) -> None:
        """Wait for and drop every gather issued ahead. Collective."""
        self.forward.drain()
        self.from_step = None

    def regather(self, unit: Unit) -> Flight:
        """Z3 backward: `unit`'s values again, for one owed use (the copy goes after the last)."""
        self._flush()
        flight = self.landed.pop(id(unit), None) or self.backward.take(unit)
        unit.owed_regathers = max(0, unit.owed_regathers - 1)
        if unit.owed_regathers:
            self.landed[id(unit)] = flight
        return flight.wait()

    def _restart_backward(self) -> None:
        self.backward.drain()
        self.landed.clear()
        self.backward.restart(self.order)

    def deposit(self, g: Group, e: Entry, grad: Tensor) -> None:
        """Add the gradient (shape `e.shape`) of one handed-out value of `e` into bucket `g`."""
        if not self.pass_open:  # once per backward pass
            self.pass_open = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        self._flush()
        i = g.index[id(e)]
        if g.flat is None:
            g.flat = torch.empty(g.numel, dtype=g.reduce_dtype, device=g.device)
        part = g.part(g.flat, i)
        part.add_(grad) if g.has[i] else part.copy_(grad)
        g.has[i] = True
        g.owed[i] = max(0, g.owed[i] - 1)
        if self.sync and not any(g.owed):
            self.ready.append(g)
            if not self.depth:
                self._flush()

    def _end_backward(self) -> None:
        """Reduce every sum (sync on), complete or not, and land them all: after backward every
        `.grad` is final, as torch's (clip_grad_norm_ and other code read them)."""
        self.pass_open = False
        for g in self.buckets:
            g.owed = [0] * len(g.entries)
        self.ready += self.buckets if self.sync else []  # after the complete ones
        self.wait_reduces()
        self._restart_backward()

    def _flush(self) -> None:  # the sums made complete since the last call
        ready, self.ready = self.ready, []
        for g in ready:
            self._reduce(g)

    def _reduce(self, g: Group) -> None:
        """Issue the reduce of the bucket's sum (zeros for entries it holds no gradient of)."""
        flat, members = g.flat, tuple(i for i, h in enumerate(g.has) if h)
        g.flat, g.has = None, [False] * len(g.entries)
        if flat is None:
            return
        for i in set(range(len(g.entries))) - set(members):
            g.part(flat, i).zero_()
        work = None
        if self.st.shard_size > 1:
            with phase(f"backward (gradient reduce of {g.names})"):
                work = reduce_start(flat, g.owner, self.st.shard_group)
        self.reduces.append([g, flat, work, members])
        if not self.depth:
            self.wait_reduces()
            return
        # land the oldest beyond the cap (bucket sizes and order alike on every rank)
        sizes = [r[1].numel() * r[1].element_size() for r in self.reduces]
        first = 0
        while first < len(sizes) - 1 and sum(sizes[first:]) > self.reduce_cap:
            first += 1
        if first:
            self._land(first)

    def wait_reduces(self) -> None:
        """Land every issued reduce (HSDP: stage 2 issued here, in issue order) as the mean
        (sum / (G·R)), or the sum / `Entry.grad_divide`, in each global owner's `.grad`."""
        self._flush()
        self._land(len(self.reduces))

    def _land(self, n: int) -> None:
        """`wait_reduces` for the `n` oldest issued reduces."""
        st, pending, self.reduces = self.st, self.reduces[:n], self.reduces[n:]
        for r in pending:  # the work becomes stage 2's
            g, flat, work, _ = r
            with blocked(), phase(f"backward (gradient reduce of {g.names})"):
                if work is not None:
                    work.wait()
                hsdp = st.replicate_group is not None and st.is_local_owner(g.entries[0])
                r[2] = reduce_start(flat, g.owner_replica, st.replicate_group) if hsdp else None
        scale = st.shard_size * st.replicate_size
        for g, flat, work, members in pending:
            if work is not None:
                wait_work(work, f"backward (gradient reduce of {g.names})")
            for i in members:
                e = g.entries[i]
                if not e.param.requires_grad:
                    continue
                if st.is_global_owner(e):
                    div = scale if e.grad_divide is None else e.grad_divide
                    grad = g.part(flat, i).to(e.param.dtype).div_(div)
                    with torch.no_grad():  # what autograd's AccumulateGrad does
                        if e.param.grad is None:
                            e.param.grad = grad
                        else:
                            e.param.grad += grad
                elif e.param.grad is None and not st.is_local_owner(e):
                    # a 0-size gradient on the 0-size placeholder: every rank's model has a
                    # .grad where the owner's has one (torch's norms: dedicated/_torch_norms.py)
                    e.param.grad = torch.zeros_like(e.param)
