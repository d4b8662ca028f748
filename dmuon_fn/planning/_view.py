"""One rank's view of a `Plan`: where each parameter's owner sits relative to this rank.

Both faces read ownership through it: the functional API's `FnPlan` and the object API's
`Topology` (dedicated/_entries.py). A rank at (shard_rank, replica_rank) is the *local owner*
of a parameter whose owner slot has its shard index (it holds the full parameter between
steps), and the *global owner* when the replica matches too (it holds the master and the
optimizer state, and runs the update).
"""

from __future__ import annotations

from dataclasses import dataclass

from ._partition import Plan

# per parameter: (owner shard, is local owner, shard size, owner replica, is owner replica,
# replicate size), the ints the collective ops take
Route = tuple[int, int, int, int, int, int]


@dataclass(frozen=True)
class RankView:
    """`plan` seen from the rank at (shard_rank, replica_rank); plain hashable data."""

    plan: Plan
    shard_rank: int = 0
    replica_rank: int = 0

    def coords(self, name: str) -> tuple[int, int]:
        """(shard, replica) of `name`'s owner."""
        return self.plan.coords(self.plan.slot(name))

    def is_local_owner(self, name: str) -> bool:
        return self.coords(name)[0] == self.shard_rank

    def is_global_owner(self, name: str) -> bool:
        return self.coords(name) == (self.shard_rank, self.replica_rank)

    def route(self, name: str) -> Route:
        s, r = self.coords(name)
        G, R = self.plan.shard_size, self.plan.replicate_size
        return (s, int(s == self.shard_rank), G, r, int(r == self.replica_rank), R)
