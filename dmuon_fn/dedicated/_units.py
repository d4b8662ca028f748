"""What the scheduler moves. A *unit* (one layer's module subtree, keyed as
`planning/_partition.layer_keys` keys layers, or one module outside repeated blocks) is gathered
per `Group` of its entries (one global owner and dtypes): one broadcast of their concatenation
from the owner (a `Flight`). One module's entries grouped alike form a reduce bucket
(dedicated/_reduce.py). Rationale: proofs/dedicated_notes.md.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import accumulate

from torch import Tensor

from ._entries import Entry, wait_work


class Group:
    """Entries with one global owner and dtypes, moved as one flat buffer of `numel` elements
    (entry i at [offsets[i], offsets[i + 1])): a unit's gather group, or a module's bucket."""

    def __init__(self, entries: Sequence[Entry]) -> None:
        self.entries = tuple(entries)
        e0 = self.entries[0]
        self.owner, self.owner_replica, self.device = e0.owner_shard, e0.owner_replica, e0.device
        self.dtype, self.reduce_dtype = e0.dtype, e0.reduce_dtype
        self.offsets = (0, *accumulate(e.shape.numel() for e in self.entries))
        self.numel = self.offsets[-1]
        self.index = {id(e): i for i, e in enumerate(self.entries)}
        # a bucket's backward: handed-out values per entry still owing a gradient; the sum of
        # the gradients (kept across passes while sync is off), and which entries it holds
        self.owed = [0] * len(self.entries)
        self.flat: Tensor | None = None
        self.has = [False] * len(self.entries)

    def part(self, flat: Tensor, i: int) -> Tensor:
        return flat[self.offsets[i] : self.offsets[i + 1]].view(self.entries[i].shape)

    @property
    def names(self) -> str:
        return ", ".join(e.name for e in self.entries)


@dataclass(eq=False)
class Unit:
    key: str
    groups: tuple[Group, ...]
    owed_regathers: int = 0  # Z3 backward: re-gathered values still to be taken
    handles: list[Tensor] = field(default_factory=list)  # of its slots (dedicated/_gather.py)

    def __post_init__(self) -> None:
        # id(entry) -> (index of its group, the group)
        self.group_of = {id(e): (i, g) for i, g in enumerate(self.groups) for e in g.entries}


def make_groups(entries: Sequence[Entry]) -> tuple[Group, ...]:
    """`entries` (each once) grouped by (global owner, dtypes, device), ordered by owner."""
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
    """One unit's gathers: `flats[i]` is group i's buffer, final once `wait` returns."""

    def __init__(self, unit: Unit, flats: list[Tensor], works: list, what: str) -> None:
        self.unit, self.flats, self.works, self.what = unit, flats, works, what

    def wait(self) -> Flight:
        for i, w in enumerate(self.works):
            if w is not None:
                wait_work(w, f"{self.what} of {self.unit.groups[i].names}")
                self.works[i] = None
        return self

    def value(self, e: Entry) -> Tensor:
        i, g = self.unit.group_of[id(e)]
        return g.part(self.flats[i], g.index[id(e)])


class Cursor:
    """A walk through the recorded unit order, forward (`step` 1) or backward (-1: Z3's
    re-gathers), with the next `depth` units' gathers issued ahead (`ahead`: position -> them)."""

    def __init__(
        self, issue: Callable[[Unit, str], Flight], depth: int, step: int, what: str
    ) -> None:
        self.issue, self.depth, self.step, self.what = issue, depth, step, what
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
            self.stop()
        flight = flight or self.issue(unit, self.what)
        self.prefetch()
        return flight

    def prefetch(self) -> None:
        if self.pos < 0:
            return
        if self.step > 0:
            stop = min(self.pos + self.depth, len(self.order))
        else:
            stop = max(self.pos - self.depth, -1)
        for j in range(self.pos, stop, self.step):
            if j not in self.ahead:
                self.ahead[j] = self.issue(self.order[j], self.what)

    def drain(self) -> None:
        """Wait for (every rank issued them alike) and drop the gathers issued ahead."""
        for pos in sorted(self.ahead):
            self.ahead[pos].wait()
        self.ahead.clear()

    def stop(self) -> None:
        self.drain()
        self.pos = -1
