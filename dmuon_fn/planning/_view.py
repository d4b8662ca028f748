"""`RankView`: one rank's view of a partition `Plan`, read by both faces: a parameter's *local
owner* shares its owner slot's shard (it holds the full parameter between steps), its *global
owner* the replica too (master, state, update)."""

from __future__ import annotations

from dataclasses import dataclass

from ._plan import Plan


@dataclass(frozen=True)
class RankView:
    """`plan` seen from the rank at (shard_rank, replica_rank); plain hashable data."""

    plan: Plan
    shard_rank: int = 0
    replica_rank: int = 0

    def coords(self, name: str) -> tuple[int, int]:
        return self.plan.coords(self.plan.slot(name))

    def is_local_owner(self, name: str) -> bool:
        return self.coords(name)[0] == self.shard_rank

    def is_global_owner(self, name: str) -> bool:
        return self.coords(name) == (self.shard_rank, self.replica_rank)

    def held(self, name: str) -> str | None:
        """The plan name of what this rank holds of parameter `name` between steps as a local
        owner (the parameter, or its piece on this shard column), else None."""
        return next((p for p in self.plan.pieces(name) if self.is_local_owner(p)), None)

    def route(self, name: str) -> tuple[int, int, int, int, int, int]:
        """The ints the collective ops take: (owner shard, is local owner, shard size, owner
        replica, is owner replica, replicate size)."""
        s, r = self.coords(name)
        G, R = self.plan.shard_size, self.plan.replicate_size
        return (s, int(s == self.shard_rank), G, r, int(r == self.replica_rank), R)
