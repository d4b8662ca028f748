"""Prefetched gathers and asynchronous reduces of a model's dedicated parameters (object API).

Forward: units (dedicated/_units.py) are needed in the order recorded on the previous forward;
a unit's gathers are taken from those issued ahead (or issued now), then the next `depth`
units' are issued. A unit out of that order makes every rank drain the gathers issued ahead and
gather it at once; the new order is recorded. Peak: depth + 1 units' gathered copies (Z3).
Backward: gradients go to the `Reducer` (dedicated/_reduce.py); Z3 re-gathers a unit once for
all its saved values, walking the recorded order in reverse. `Muon(gather_in_step=True)`: the
step issues the next forward's gathers (`gather_for_next_forward`) and the forward checks that
the owners' parameters did not change since. Prefetch 0: everything is waited for where it is
issued. Collectives are issued at points of the module order only, one order on every rank
(proofs/prefetch.md).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ._entries import Entry, Topology, broadcast_start
from ._reduce import Reducer
from ._units import Cursor, Flight, Group, Unit


def gather_unit(topo: Topology, unit: Unit, what: str) -> Flight:
    """Issue `unit`'s gathers: per group, the owner's concatenated values (a copy, in the
    group's dtype) broadcast over the shard group into `numel`-element buffers elsewhere."""
    flats, works = [], []
    for g in unit.groups:
        if topo.is_local_owner(g.entries[0]):
            parts = []
            for e in g.entries:
                e.wait_publish()  # an HSDP publish may still be writing the value
                parts.append(e.param.detach().reshape(-1).to(g.dtype))
            flat = torch.cat(parts)  # a copy: the step updates the parameter in place
        else:
            flat = torch.empty(g.numel, dtype=g.dtype, device=g.device)
        work = None
        if topo.shard_size > 1:
            work = broadcast_start(flat, g.owner, topo.shard_group, f"{what} of {g.names}")
        flats.append(flat)
        works.append(work)
    return Flight(unit, flats, works, what)


class Scheduler:
    """Runs a model's dedicated gathers and reduces (module docstring). `depth`: units whose
    gathers are issued ahead (0: none, everything waited for at once)."""

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
        self.landed: dict[int, Flight] = {}  # backward: id(unit) -> its re-gathered copy
        # the step issued the forward cursor's gathers (`gather_for_next_forward`): each local
        # owner's (entry, parameter version) at the issue, checked when that forward begins
        self.from_step: list[tuple[Entry, int]] | None = None
        self.pass_open = False  # a backward pass has an end-of-pass callback queued

    @property
    def buckets(self) -> list[Group]:
        return self.reducer.buckets

    def _issue(self, unit: Unit, what: str) -> Flight:
        with torch.profiler.record_function("dmuon::param_gather"):  # a label for profiles
            flight = gather_unit(self.topo, unit, what)
            return flight if self.depth else flight.wait()

    # ------------------------------------------------------------------ forward

    def begin_forward(self) -> None:
        """The model's forward starts: land last backward's reduces, forget what an earlier
        forward left owed (a forward without backward), issue the first units (keeping those
        the step issued for it)."""
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
        """`e`'s full value for a module of `unit` about to run; `bucket`: the value takes part
        in autograd, so backward will deposit its gradient there."""
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

    # ------------------------------------------------------------------ gathers in the step

    def next_forward_order(self, keep_all: bool) -> tuple[int, dict[int, int]]:
        """(n, first): the step gathers the recorded order's first n units for the next forward
        (all with `keep_all`, Z2; else `depth`, Z3's bound), and `first[id(entry)]` is the
        first of them that holds the entry: its update must come before that unit's gather."""
        units = self.order if keep_all else self.order[: self.depth]
        first: dict[int, int] = {}
        for j, unit in enumerate(units):
            for g in unit.groups:
                for e in g.entries:
                    first.setdefault(id(e), j)
        return len(units), first

    def gather_for_next_forward(self, j: int) -> None:
        """Issue the gathers of recorded unit `j` now (inside the step, once this rank has
        updated its own parameters of it), kept for the next forward. Every rank calls it for
        j = 0, 1, ... in turn: one collective order."""
        if j == 0:
            self.drop_ahead()
            self.from_step = []
        unit = self.order[j]
        self.forward.ahead[j] = self._issue(unit, "step (the next forward's parameter gather)")
        for g in unit.groups:
            if self.topo.is_local_owner(g.entries[0]):
                self.from_step += [(e, e.param._version) for e in g.entries]

    def wait_ahead(self) -> None:
        """Block until the gathers issued ahead have landed (kept for the forward)."""
        for flight in self.forward.ahead.values():
            flight.wait()

    def drop_ahead(self) -> None:
        """Wait for and drop every gather issued ahead (the parameters are about to be
        overwritten). Collective: every rank calls it at the same point of the program."""
        self.forward.drain()
        self.from_step = None

    def _check_from_step(self) -> None:
        """A parameter changed on its owner since the step sent its value raises (the other
        ranks hold the old value)."""
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

    # ------------------------------------------------------------------ backward

    def regather(self, unit: Unit) -> Flight:
        """`unit`'s values again in backward (Z3): one re-gather for all of them."""
        self.reducer.flush()
        key = id(unit)
        if key not in self.landed:
            self.landed[key] = self.backward.take(unit)
        return self.landed[key].wait()

    def release(self, unit: Unit) -> None:
        """One re-gathered value of `unit` was taken; the copy goes once none is owed."""
        unit.owed_regathers -= 1
        if unit.owed_regathers <= 0:
            unit.owed_regathers = 0
            self.landed.pop(id(unit), None)

    def deposit(self, g: Group, e: Entry, grad: Tensor) -> None:
        """The gradient of one handed-out value of `e` (backward), into its module's bucket."""
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
        """Land every issued reduce in the global owners' `.grad`."""
        self.reducer.wait()

    def set_sync(self, sync: bool) -> None:
        """Gradient sync on (reduce) or off (accumulate on every rank, no traffic)."""
        self.reducer.sync = bool(sync)
