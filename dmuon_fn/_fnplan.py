"""The functional API's plan for one rank: who owns what, as plain hashable data (a compile-time
constant of the step), below both the step (`_functional.py`) and its Z3 stages
(`_functional_z3.py`)."""

from __future__ import annotations

from dataclasses import dataclass

from ._partition import Plan

Route = tuple[int, int, int, int, int, int]


@dataclass(frozen=True)
class FnPlan:
    """Who owns what, for this rank: plain data, hashable, a compile-time constant."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    muon: frozenset[str]
    trainable: frozenset[str]  # requires_grad at plan time; `update` leaves the rest as they are
    routes: tuple[Route, ...]  # per name: (src, is_src, G, rep_src, is_rep_src, R)
    group: str
    rep_group: str
    shard_size: int
    replicate_size: int
    partition: Plan

    def route(self, name: str) -> Route:
        return self.routes[self.names.index(name)]

    def shape(self, name: str) -> tuple[int, ...]:
        return self.shapes[self.names.index(name)]

    def is_local_owner(self, name: str) -> bool:
        return bool(self.route(name)[1])

    def is_global_owner(self, name: str) -> bool:
        r = self.route(name)
        return bool(r[1] and r[4])
