"""One rank's view of a `Plan`, read by both faces (proofs/dedicated_notes.md)."""

from __future__ import annotations

from dataclasses import dataclass

from ._partition import Plan


@dataclass(frozen=True)
class RankView:
    """`plan` from (shard_rank, replica_rank): *local owner* of a parameter whose owner slot has
    this shard (full value between steps), *global owner* if the replica matches (master, state)."""

    plan: Plan
    shard_rank: int = 0
    replica_rank: int = 0

    def coords(self, name: str) -> tuple[int, int]:
        return self.plan.coords(self.plan.slot(name))

    def is_local_owner(self, name: str) -> bool:
        return self.coords(name)[0] == self.shard_rank

    def is_global_owner(self, name: str) -> bool:
        return self.coords(name) == (self.shard_rank, self.replica_rank)

    def route(self, name: str) -> tuple[int, int, int, int, int, int]:
        """The ints the collective ops take: (owner shard, is local owner, shard size, owner
        replica, is owner replica, replicate size)."""
        s, r = self.coords(name)
        G, R = self.plan.shard_size, self.plan.replicate_size
        return (s, int(s == self.shard_rank), G, r, int(r == self.replica_rank), R)
