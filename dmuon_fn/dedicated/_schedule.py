"""Grouped, prefetched gathers and asynchronous reduces of dedicated parameters (object API).

Units, groups, buckets. Dedicated parameters are gathered per unit: the module subtree of one
layer (`layers.3`, keyed as the planner keys layers, `_partition.layer_keys`), or the one module
that holds them outside repeated blocks. A unit's parameters with one global owner and dtypes
form a group, gathered by one collective: a broadcast of their concatenation from the owner.
Gradients are reduced per bucket: one module's parameters with one global owner and dtypes,
summed in one flat buffer and reduced onto the owner by one collective (two stages under HSDP)
as soon as that module's gradients are in, not when the whole layer's are.

Forward. Units are needed in the order recorded on the previous forward, the same on every rank
(every rank runs the same program). When unit i is needed its gathers are taken from those
issued ahead, or issued now; then the gathers of the next `depth` units of the recorded order are
issued asynchronously, so they travel while unit i computes. A unit needed out of the recorded
order (a module skipped, called twice, or in another order) makes every rank wait for and drop
the same gathers issued ahead, and is gathered at once; the new order is recorded for the next
forward. Peak: the gathered copies of depth + 1 units at a time (Z3; Z2 keeps what autograd
saves).

Backward. A bucket's gradients are summed over this forward's handouts; once the last expected
one arrived, the bucket is reduced asynchronously at dmuon_fn's next hook (one event late, so a
synchronous collective issued right after ours, FSDP2's, does not queue behind it); a bucket
whose handed-out values did not all get a gradient is reduced when the backward pass ends.
`wait_reduces` lands the sums in the global owners' `.grad` (Muon.step, clip_grad_norm_,
zero_grad, checkpoints and the next forward call it; `dmuon_fn.wait_gradients(model)` for anyone
else reading `.grad`); under HSDP the second stage (across replicas) runs there, in issue order.
Z3 re-gathers a unit once for all its saved values and issues the re-gathers of the `depth`
units before it (reverse recorded order) ahead. With gradient sync off
(`set_requires_gradient_sync`) the sums stay on each rank and the next synchronized reduce
carries them: no collective until then.

Gathers in the step (`Muon(gather_in_step=True)`): the optimizer step issues the next
forward's gathers of the recorded order's units (Z2: all; Z3: the first `depth`) into `ahead`,
each once the rank's updates of it are done; the forward takes them as prefetched gathers. Each
owner records its parameters' version counters at the issue and checks them when the forward
begins (a change in between raises); `drop_ahead` (checkpoint loading) discards them.

Prefetch 0: every gather and reduce is issued where it is needed and waited for at once, so
nothing overlaps (the same collectives on the same bytes: results equal bit for bit).

Every collective is issued at a point that depends only on the program's module order, never on
timing, so every rank issues the same collectives in the same order (proofs/prefetch.md).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from custom_ops._collectives import reduce_start

from ..comm._counters import blocked
from ..comm._errors import phase
from ._entries import Entry, Topology


class Group:
    """Entries with one global owner and dtypes, moved by one collective: a unit's gather
    group, or a module's reduce bucket."""

    def __init__(self, entries: Sequence[Entry]) -> None:
        self.entries = tuple(entries)
        e0 = self.entries[0]
        self.owner, self.dtype, self.reduce_dtype = e0.owner_shard, e0.dtype, e0.reduce_dtype
        self.owner_replica = e0.owner_replica
        self.device = e0.device
        offsets = [0]
        for e in self.entries:
            offsets.append(offsets[-1] + e.numel)
        self.offsets, self.numel = tuple(offsets), offsets[-1]
        self.index = {id(e): i for i, e in enumerate(self.entries)}
        # backward: per entry, handed-out values still owing a gradient; the gradients' sum
        # (kept across backward passes while gradient sync is off) in one flat buffer, and
        # which entries it holds
        self.owed = [0] * len(self.entries)
        self.flat: Tensor | None = None
        self.has = [False] * len(self.entries)

    def part(self, flat: Tensor, i: int) -> Tensor:
        return flat[self.offsets[i] : self.offsets[i + 1]].view(self.entries[i].shape)

    def view(self, flat: Tensor, e: Entry) -> Tensor:
        return self.part(flat, self.index[id(e)])

    @property
    def names(self) -> str:
        return ", ".join(e.name for e in self.entries)


@dataclass(eq=False)
class Unit:
    key: str
    groups: tuple[Group, ...]
    # id(entry) -> (index of its group, the group)
    group_of: dict[int, tuple[int, Group]] = field(default_factory=dict)
    # backward: re-gathered values still to be taken (Z3) before the re-gathered copy can go
    owed_regathers: int = 0

    def __post_init__(self) -> None:
        self.group_of = {id(e): (i, g) for i, g in enumerate(self.groups) for e in g.entries}


def make_groups(entries: Sequence[Entry]) -> tuple[Group, ...]:
    """`entries` (each once) grouped by (global owner, gather dtype, reduce dtype, device),
    ordered by owner, first-seen order within."""
    groups: dict[tuple, list[Entry]] = {}
    for e in entries:
        key = ((e.owner_shard, e.owner_replica), e.dtype, e.reduce_dtype, e.device)
        members = groups.setdefault(key, [])
        if all(m is not e for m in members):
            members.append(e)
    return tuple(Group(m) for _, m in sorted(groups.items(), key=lambda kv: kv[0][0]))


def make_units(keyed: Sequence[tuple[str, Entry]]) -> list[Unit]:
    """Units from (unit key, entry) pairs (an entry in several units is gathered for each)."""
    by_key: dict[str, list[Entry]] = {}
    for key, e in keyed:
        by_key.setdefault(key, []).append(e)
    return [Unit(key, make_groups(es)) for key, es in by_key.items()]


class Flight:
    """One unit's gathers: issued (asynchronously unless the depth is 0), landed on `wait`."""

    def __init__(self, unit: Unit, flats: list[Tensor], works: list, what: str) -> None:
        self.unit, self.flats, self.works, self.what = unit, flats, works, what

    def wait(self) -> Flight:
        for i, w in enumerate(self.works):
            if w is not None:
                with blocked(), phase(f"{self.what} of {self.unit.groups[i].names}"):
                    w.wait()
                self.works[i] = None
        return self

    def value(self, e: Entry) -> Tensor:
        i, g = self.unit.group_of[id(e)]
        return g.view(self.flats[i], e)


@dataclass(eq=False)
class _Reduce:
    group: Group
    flat: Tensor
    work: object
    members: tuple[int, ...]  # indices into group.entries, in flat order
    stage2: object = None


class Scheduler:
    """Runs a model's dedicated gathers and reduces (module docstring)."""

    def __init__(
        self, topo: Topology, units: Sequence[Unit], buckets: Sequence[Group], depth: int
    ) -> None:
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 0:
            raise ValueError(f"prefetch must be an int >= 0 (0: off), got {depth!r}")
        self.topo, self.units, self.depth = topo, list(units), depth
        self.buckets = list(buckets)
        self.sync = True  # gradient sync (False: accumulate locally)
        self.order: list[Unit] = []  # the last forward's units, in order
        self.current: list[Unit] = []  # this forward's so far
        self.pos = -1  # next expected index into `order`; -1: off the recorded order
        self.ahead: dict[int, Flight] = {}  # position -> gathers issued ahead
        # the step issued `ahead` for the next forward (`gather_for_next_forward`): each local
        # owner's (entry, parameter version) at the issue, checked when that forward begins
        self.from_step: list[tuple[Entry, int]] | None = None
        self.open: tuple[Unit, Flight] | None = None
        self.bpos = -1  # backward: next expected index into `order`, downwards
        self.back: dict[int, Flight] = {}  # backward: position -> re-gathers issued ahead
        self.landed: dict[int, Flight] = {}  # backward: id(unit) -> its re-gathered copy
        self.reduces: list[_Reduce] = []
        self.ready: list[Group] = []  # complete gradient sums, reduced at the next event
        self.pass_open = False  # a backward pass has an end-of-pass callback queued

    # ------------------------------------------------------------------ collectives

    def _src(self, group: Group) -> int:
        return dist.get_global_rank(self.topo.shard_group, group.owner)

    def _issue(self, unit: Unit, what: str) -> Flight:
        with torch.profiler.record_function("dmuon::param_gather"):  # a label for profiles
            return self._issue_groups(unit, what)

    def _issue_groups(self, unit: Unit, what: str) -> Flight:
        flats, works = [], []
        for g in unit.groups:
            if self.topo.shard_rank == g.owner:
                parts = []
                for e in g.entries:
                    e.wait_publish()  # an HSDP publish may still be writing the value
                    parts.append(e.param.detach().reshape(-1).to(g.dtype))
                flat = torch.cat(parts)  # a copy: the step updates the parameter in place
            else:
                flat = torch.empty(g.numel, dtype=g.dtype, device=g.device)
            work = None
            if self.topo.shard_size > 1:
                with phase(f"{what} of {g.names}"):
                    work = dist.broadcast(
                        flat, src=self._src(g), group=self.topo.shard_group, async_op=True
                    )
            flats.append(flat)
            works.append(work)
        flight = Flight(unit, flats, works, what)
        return flight if self.depth else flight.wait()

    def _drain(self, flights: dict[int, Flight]) -> None:
        """Wait for (every rank issued them alike) and drop gathers issued ahead."""
        for pos in sorted(flights):
            flights[pos].wait()
        flights.clear()

    # ------------------------------------------------------------------ forward

    def begin_forward(self) -> None:
        """The model's forward starts: land last backward's reduces, forget what an earlier
        forward left owed (a forward without backward), issue the first units (keeping those
        the step issued for it)."""
        self.wait_reduces()
        if self.from_step is None:
            self._drain(self.ahead)
        else:
            self._check_from_step()
        for unit in self.units:
            unit.owed_regathers = 0
        for b in self.buckets:
            b.owed = [0] * len(b.entries)
        self.open, self.current = None, []
        self.pos = 0 if self.order else -1
        self._prefetch(0)

    def end_forward(self) -> None:
        self._drain(self.ahead)
        self.open = None
        if self.current:
            self.order, self.current = self.current, []
        self.pos, self.bpos = -1, len(self.order) - 1
        self._drain(self.back)
        self.landed.clear()

    # ------------------------------------------------------------------ gathers in the step

    def gather_in_step_plan(self, keep_all: bool) -> tuple[int, dict[int, int]]:
        """How many of the recorded order's units the step gathers for the next forward (all of
        them when the forward keeps every gathered copy anyway, Z2; else the first `depth`, so
        Z3's bound of depth + 1 units holds), and for each of their entries (by id) the first
        of those units that holds it: its update must come before that unit's gather."""
        units = self.order if keep_all else self.order[: self.depth]
        first: dict[int, int] = {}
        for j, unit in enumerate(units):
            for g in unit.groups:
                for e in g.entries:
                    first.setdefault(id(e), j)
        return len(units), first

    def gather_for_next_forward(self, j: int) -> None:
        """Issue the gathers of recorded unit `j` now (inside the optimizer step, once this rank
        has updated its own parameters of it), kept for the next forward. Every rank calls it
        for j = 0, 1, ... in turn: one collective order."""
        if j == 0:
            self.drop_ahead()
            self.from_step = []
        unit = self.order[j]
        self.ahead[j] = self._issue(unit, "step (the next forward's parameter gather)")
        for g in unit.groups:
            if self.topo.shard_rank == g.owner:
                self.from_step += [(e, e.param._version) for e in g.entries]

    def wait_ahead(self) -> None:
        """Block until the gathers issued ahead have landed (kept for the forward)."""
        for flight in self.ahead.values():
            flight.wait()

    def drop_ahead(self) -> None:
        """Wait for and drop every gather issued ahead (a checkpoint is about to overwrite the
        parameters: the next forward gathers afresh). Collective in effect: every rank calls it
        at the same point of the program."""
        self._drain(self.ahead)
        self.from_step = None

    def _check_from_step(self) -> None:
        """The gathers the step issued carry the values the step wrote: a parameter changed since
        on its owner (only the owner can see it, and the other ranks have received the old
        value) is an error, never a silent divergence."""
        changed = [e.name for e, v in self.from_step if e.param._version != v]
        self.from_step = None
        if changed:
            self._drain(self.ahead)
            raise RuntimeError(
                f"{changed[:3]}{'...' if len(changed) > 3 else ''} changed between "
                "optimizer.step() and the next forward, after Muon(gather_in_step=True) had "
                "sent their values to the other ranks, which now hold the old ones. Change "
                "dedicated parameters only before step() (or load them with "
                "dmuon_fn.load_checkpoint), or use gather_in_step=False"
            )

    def _prefetch(self, start: int) -> None:
        if self.pos < 0:
            return
        for j in range(start, min(start + self.depth, len(self.order))):
            if j not in self.ahead:
                self.ahead[j] = self._issue(self.order[j], "forward (parameter gather)")

    def value(self, e: Entry, unit: Unit, bucket: Group | None) -> Tensor:
        """`e`'s full value for a module of `unit` about to run (forward); `bucket`: the value
        takes part in autograd, so backward will deposit its gradient there."""
        flight = self.open_flight(unit).wait()
        if bucket is not None:
            bucket.owed[bucket.index[id(e)]] += 1
        return flight.value(e)

    def open_unit(self, unit: Unit) -> None:
        """`unit` is about to run: its gathers issued (taken from those issued ahead)."""
        if self.open is None or self.open[0] is not unit:
            self._open(unit)

    def open_flight(self, unit: Unit) -> Flight:
        self.open_unit(unit)
        return self.open[1]

    def _open(self, unit: Unit) -> None:
        self.open = None  # the last unit's copy goes before the next one is gathered
        self.current.append(unit)
        if len(self.current) > 4 * len(self.units) + 4:
            del self.current[: len(self.units)]  # no end_forward: the root is never called
        if 0 <= self.pos < len(self.order) and self.order[self.pos] is unit:
            flight = self.ahead.pop(self.pos, None)
            self.pos += 1
        else:
            self._drain(self.ahead)
            self.pos, flight = -1, None
        self.open = (unit, flight or self._issue(unit, "forward (parameter gather)"))
        self._prefetch(self.pos)

    # ------------------------------------------------------------------ backward

    def regather(self, unit: Unit) -> Flight:
        """`unit`'s values again in backward (Z3): one re-gather for all of them, the units
        before it issued ahead in reverse recorded order."""
        self._flush()
        key = id(unit)
        if key not in self.landed:
            flight = None
            if 0 <= self.bpos < len(self.order) and self.order[self.bpos] is unit:
                flight = self.back.pop(self.bpos, None)
                self.bpos -= 1
            else:
                self._drain(self.back)
                self.bpos = -1
            what = "backward (Z3 parameter re-gather)"
            self.landed[key] = flight or self._issue(unit, what)
            if self.bpos >= 0:
                for j in range(self.bpos, max(self.bpos - self.depth, -1), -1):
                    if j not in self.back:
                        self.back[j] = self._issue(self.order[j], what)
        return self.landed[key].wait()

    def release(self, unit: Unit) -> None:
        """One re-gathered value of `unit` was taken; the copy goes once none is owed."""
        unit.owed_regathers -= 1
        if unit.owed_regathers <= 0:
            unit.owed_regathers = 0
            self.landed.pop(id(unit), None)

    def deposit(self, g: Group, e: Entry, grad: Tensor) -> None:
        """The gradient of one handed-out value of `e` (backward), into its module's bucket."""
        self._pass()
        self._flush()
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
                self._flush()

    def _flush(self) -> None:
        """Reduce the sums made complete since the last event. One event late, not at once:
        a collective that FSDP2 (or anyone) issues synchronously right after ours would wait
        behind our whole sum on a slow link; issued at dmuon_fn's next hook, ours goes after
        theirs. Still a point in program order, the same on every rank."""
        ready, self.ready = self.ready, []
        for g in ready:
            self._reduce(g)

    def _pass(self) -> None:
        """Queue the end-of-backward callback once per backward pass."""
        if not self.pass_open:
            self.pass_open = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _end_backward(self) -> None:
        self.pass_open = False
        self._flush()
        for g in self.buckets:
            g.owed = [0] * len(g.entries)
            if self.sync and g.flat is not None:
                self._reduce(g)
        self._drain(self.back)
        self.landed.clear()
        self.bpos = len(self.order) - 1

    def _reduce(self, g: Group) -> None:
        """Reduce the group's gradient sum (what every backward since the last reduce left in
        it). Which entries it holds depends only on which values the program handed out and
        used, the same on every rank; the others' parts are zeros."""
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
            self.wait_reduces()

    def wait_reduces(self) -> None:
        """Land every issued reduce in the global owners' `.grad` (HSDP: after the second
        stage, issued here in issue order)."""
        self._flush()
        if not self.reduces:
            return
        topo, pending, self.reduces = self.topo, self.reduces, []
        for r in pending:
            with blocked(), phase(f"backward (gradient reduce of {r.group.names})"):
                if r.work is not None:
                    r.work.wait()
                if topo.replicate_group is not None and topo.shard_rank == r.group.owner:
                    r.stage2 = reduce_start(r.flat, r.group.owner_replica, topo.replicate_group)
        for r in pending:
            if r.stage2 is not None:
                with blocked(), phase(f"backward (gradient reduce of {r.group.names})"):
                    r.stage2.wait()
            self._land(r)

    def _land(self, r: _Reduce) -> None:
        """The mean (sum / (G·R)) into each global owner's `.grad`: views of the reduced buffer
        where the dtypes agree, so landing copies nothing."""
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

    # ------------------------------------------------------------------ accumulation

    def set_sync(self, sync: bool) -> None:
        self.sync = bool(sync)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        prev, self.sync = self.sync, False
        try:
            yield
        finally:
            self.sync = prev
