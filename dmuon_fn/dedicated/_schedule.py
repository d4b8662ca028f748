"""Prefetched gathers and asynchronous reduces of a model's dedicated parameters (object API).

Forward takes each unit's gathers from those issued ahead in the order recorded on the previous
forward, then issues the next `depth` units'; a unit out of that order drains them on every rank
and is gathered at once. Z3's backward re-gathers walk the order in reverse; gradients go to the
`Reducer`. Z3 peak: depth + 1 units' gathered copies. One collective order on every rank
(proofs/prefetch.md claims 1, 5 and 9).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ._entries import Entry, Topology, broadcast_start
from ._reduce import Reducer
from ._units import Cursor, Flight, Group, Unit


class Scheduler:
    """Runs a model's dedicated gathers and reduces. `depth`: units whose gathers are issued
    ahead (0: none, everything waited for where it is issued)."""

    def __init__(
        self, topo: Topology, units: Sequence[Unit], buckets: Sequence[Group], depth: int
    ) -> None:
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 0:
            raise ValueError(f"prefetch must be an int >= 0 (0: off), got {depth!r}")
        self.topo, self.units = topo, list(units)
        self.depth = depth
        self.reducer = Reducer(topo, buckets, self.depth)
        self.forward = Cursor(self._issue, self.depth, 1, "forward (parameter gather)")
        self.backward = Cursor(self._issue, self.depth, -1, "backward (Z3 parameter re-gather)")
        self.order: list[Unit] = []  # the last forward's units, in order
        self.current: list[Unit] = []  # this forward's so far
        self.open: tuple[Unit, Flight] | None = None  # the unit computing, and its gathers
        self.landed: dict[int, Flight] = {}  # Z3 backward: id(unit) -> its re-gathered copy
        # gather_in_step: each local owner's (entry, param version) when the step sent it
        self.from_step: list[tuple[Entry, int]] | None = None
        self.pass_open = False  # a backward pass has an end-of-pass callback queued

    @property
    def buckets(self) -> list[Group]:
        return self.reducer.buckets

    def _issue(self, unit: Unit, what: str) -> Flight:
        """Per group, the owner's concatenated values (a copy in the group's dtype) broadcast
        over the shard group into `numel`-element buffers elsewhere."""
        topo, flats, works = self.topo, [], []
        with torch.profiler.record_function("dmuon::param_gather"):  # a label for profiles
            for g in unit.groups:
                if topo.is_local_owner(g.entries[0]):
                    for e in g.entries:
                        e.wait_publish()  # an HSDP publish may still be writing the value
                    # a copy: the step updates the parameter in place
                    flat = torch.cat([e.param.detach().reshape(-1).to(g.dtype) for e in g.entries])
                else:
                    flat = torch.empty(g.numel, dtype=g.dtype, device=g.device)
                flats.append(flat)
                works.append(
                    broadcast_start(flat, g.owner, topo.shard_group, f"{what} of {g.names}")
                    if topo.shard_size > 1
                    else None
                )
            flight = Flight(unit, flats, works, what)
            return flight if self.depth else flight.wait()

    def begin_forward(self) -> None:
        """Land last backward's reduces, forget what an earlier forward left owed, issue the
        first units (keeping those the step issued)."""
        self.wait_reduces()
        if self.from_step is None:
            self.forward.drain()
        else:
            self._check_from_step()
        for unit in self.units:
            unit.owed_regathers = 0
        self.reducer.forget_owed()
        self.open, self.current = None, []
        self.forward.restart(self.order)
        self.forward.prefetch()

    def end_forward(self) -> None:
        self.forward.stop()
        self.open = None
        if self.current:
            self.order, self.current = self.current, []
        self._restart_backward()

    def value(self, e: Entry, unit: Unit, bucket: Group | None) -> Tensor:
        """`e`'s full value for a module of `unit`; `bucket`: its gradient is owed there."""
        flight = self.open_unit(unit).wait()
        if bucket is not None:
            self.reducer.expect(bucket, e)
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

    def next_forward_order(self, keep_all: bool) -> tuple[int, dict[int, int]]:
        """(n, first): the step gathers the recorded order's first n units (all with
        `keep_all`, else `depth`); `first[id(entry)]`: the first of them holding the entry."""
        units = self.order if keep_all else self.order[: self.depth]
        first: dict[int, int] = {}
        for j, unit in enumerate(units):
            for g in unit.groups:
                for e in g.entries:
                    first.setdefault(id(e), j)
        return len(units), first

    gather_in_step_plan = next_forward_order  # the name Muon calls until it moves over

    def gather_for_next_forward(self, j: int) -> None:
        """Issue recorded unit `j`'s gathers for the next forward, once this rank updated its
        parameters of it. Every rank calls it for j = 0, 1, ... in turn."""
        if j == 0:
            self.drop_ahead()
            self.from_step = []
        unit = self.order[j]
        self.forward.ahead[j] = self._issue(unit, "step (the next forward's parameter gather)")
        for g in unit.groups:
            if self.topo.is_local_owner(g.entries[0]):
                self.from_step += [(e, e.param._version) for e in g.entries]

    def wait_ahead(self) -> None:
        for flight in self.forward.ahead.values():
            flight.wait()

    def drop_ahead(self) -> None:
        """Wait for and drop every gather issued ahead. Collective."""
        self.forward.drain()
        self.from_step = None

    def _check_from_step(self) -> None:
        changed = [e.name for e, v in self.from_step if e.param._version != v]
        self.from_step = None
        if changed:
            self.forward.drain()
            raise RuntimeError(
                f"{changed[:3]}{'...' if len(changed) > 3 else ''} changed between "
                "optimizer.step() and the next forward, after Muon(gather_in_step=True) had "
                "sent their values to the other ranks, which now hold the old ones. Change "
                "dedicated parameters only before step() (or load them with "
                "dmuon_fn.load_checkpoint), or use gather_in_step=False"
            )

    def regather(self, unit: Unit) -> Flight:
        """Z3 backward: `unit`'s values again, one re-gather for all of them."""
        self.reducer.flush()
        key = id(unit)
        if key not in self.landed:
            self.landed[key] = self.backward.take(unit)
        return self.landed[key].wait()

    def release(self, unit: Unit) -> None:
        """One re-gathered value of `unit` was taken; the copy goes once none is owed."""
        unit.owed_regathers = max(0, unit.owed_regathers - 1)
        if not unit.owed_regathers:
            self.landed.pop(id(unit), None)

    def deposit(self, g: Group, e: Entry, grad: Tensor) -> None:
        if not self.pass_open:  # once per backward pass
            self.pass_open = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        self.reducer.deposit(g, e, grad)

    def _end_backward(self) -> None:
        self.pass_open = False
        self.reducer.end_pass()
        self._restart_backward()

    def _restart_backward(self) -> None:
        self.backward.drain()
        self.landed.clear()
        self.backward.restart(self.order)

    def wait_reduces(self) -> None:
        self.reducer.wait()

    def set_sync(self, sync: bool) -> None:
        self.reducer.sync = bool(sync)
