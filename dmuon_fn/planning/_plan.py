"""The partition planner's output: a frozen `Plan` of plain data, the owner slot of every
dedicated parameter, equal on every rank (`planning/_partition.py` makes it;
proofs/partition.md)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from ..ns._blocks import Blocks


@dataclass(frozen=True)
class Plan:
    """Owner slot of every dedicated parameter; plain data, identical on every rank. Slot s (of
    world_size = shard_size · replicate_size) is global rank s of a (replicate, shard) mesh: shard
    s % shard_size of replica s // shard_size. The owner keeps the fp32 master and optimizer state
    and runs the update; its shard column holds the full parameter between steps."""

    # per parameter in name order, but for the sizes and slot_* (per slot)
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    slots: tuple[int, ...]  # owner slot
    layers: tuple[str, ...]  # layer key
    matrix: tuple[bool, ...]  # Muon (else elementwise)
    costs: tuple[float, ...]  # FLOPs
    nbytes: tuple[int, ...]
    world_size: int
    replicate_size: int
    slot_loads: tuple[float, ...]  # per slot: sum of costs
    slot_bytes: tuple[int, ...]  # per slot: sum of nbytes
    ns_flops: tuple[float, ...]  # per parameter: the Newton-Schulz part of its cost (elementwise 0)
    # tensor parallelism (proofs/partition.md §8): per parameter, its layout and its NS tensor rank
    tensor_size: int = 1
    tensor_slots: tuple[int, ...] = ()
    layouts: tuple[str, ...] = ()
    # per parameter: how it is made of matrices (None when elementwise)
    blocks: tuple[Blocks | None, ...] = ()
    # (parameter, its pieces' names in order) per sliced parameter, by name; the pieces stand
    # in `names` for the parameter (planning/_slices.py: `take` and `join`)
    sliced: tuple[tuple[str, tuple[str, ...]], ...] = ()
    # the sliced parameters whose pieces are a team (one matrix cut along its long side), by
    # name; per plan name, a team member's collective bytes per step (proofs/team_ns.md claim 5)
    teams: tuple[str, ...] = ()
    team_bytes: tuple[float, ...] = ()
    # gathered groups (§12): consecutive pieces of one parameter, all cut along one dim, whose
    # first piece's holder orthogonalizes them all together, gathered; by their first piece's name
    gathered: tuple[tuple[str, ...], ...] = ()

    @property
    def shard_size(self) -> int:
        return self.world_size // self.replicate_size

    def _index(self, name: str) -> int:
        i, hi = 0, len(self.names)  # bisect_left, in Python so that dynamo traces it
        while i < hi:
            mid = (i + hi) // 2
            i, hi = (mid + 1, hi) if self.names[mid] < name else (i, mid)
        if i == len(self.names) or self.names[i] != name:
            raise KeyError(f"{name!r} is not in the plan ({len(self.names)} parameters)")
        return i

    def slot(self, name: str) -> int:
        """Owner slot of `name` in [0, world_size)."""
        return self.slots[self._index(name)]

    def coords(self, slot: int) -> tuple[int, int]:
        """(shard, replica) of `slot`."""
        return slot % self.shard_size, slot // self.shard_size

    def label(self, slot: int) -> int | tuple[int, int]:
        """`slot` as users name owners: the rank (1-D mesh), or (shard, replica) under HSDP."""
        return slot if self.replicate_size == 1 else self.coords(slot)

    def owner(self, name: str) -> int | tuple[int, int]:
        """`label` of `name`'s owner slot."""
        return self.label(self.slot(name))

    def shape(self, name: str) -> tuple[int, ...]:
        """The shape of plan name `name` (a parameter, or a piece of a sliced one)."""
        return self.shapes[self._index(name)]

    def pieces(self, name: str) -> tuple[str, ...]:
        """The plan names holding parameter `name`: its pieces if it is sliced, else (name,)."""
        for n, ps in self.sliced:
            if n == name:
                return ps
        return (name,)

    def team(self, name: str) -> tuple[str, ...]:
        """The members' pieces of parameter `name` if it is a team (its matrix cut along its
        long side, orthogonalized together; a member's slice held in a gathered group: its first
        piece), else ()."""
        return self.units(name) if name in self.teams else ()

    def units(self, name: str) -> tuple[str, ...]:
        """The plan names parameter `name` is orthogonalized in: its pieces, a gathered group
        by its first piece (the others orthogonalize nothing, §12)."""
        rest = {p for g in self.gathered for p in g[1:]}
        return tuple(p for p in self.pieces(name) if p not in rest)

    def gathered_group(self, name: str) -> tuple[str, ...]:
        """The gathered group plan name `name` (a piece) is in, its first piece first, else ()."""
        return next((g for g in self.gathered if name in g), ())

    def tensor_slot(self, name: str) -> int:
        """The tensor rank of `name`'s owner slot that orthogonalizes it (0 without TP; LOCAL:
        each tensor rank its own part, whole matrices)."""
        return self.tensor_slots[self._index(name)] if self.tensor_slots else 0

    def blocks_of(self, name: str) -> Blocks | None:
        """How `name` (a parameter or a piece) is made of matrices (None: elementwise; a plan
        without: one matrix)."""
        return self.blocks[self._index(self.pieces(name)[0])] if self.blocks else Blocks()

    def canonical(self) -> str:
        """The JSON `digest` hashes: sizes and (name, shape, slot) in name order; with tensor
        parallelism also the tensor size and (layout, tensor slot) per name; the blocks per name
        when any matrix is more than one 2-D matrix."""
        body = {
            "world_size": self.world_size,
            "replicate_size": self.replicate_size,
            "params": [
                [n, list(sh), s]
                for n, sh, s in zip(self.names, self.shapes, self.slots, strict=True)
            ],
        }
        if self.tensor_slots or self.layouts:
            body["tensor_size"] = self.tensor_size
            body["tensor"] = [list(x) for x in zip(self.layouts, self.tensor_slots, strict=True)]
        if self.teams:
            body["teams"] = list(self.teams)
        if self.gathered:
            body["gathered"] = [list(g) for g in self.gathered]
        if any(b is not None and b != Blocks() for b in self.blocks):
            body["blocks"] = [str(b) if b is not None else "" for b in self.blocks]
        return json.dumps(body, separators=(",", ":"), ensure_ascii=True)

    def digest(self) -> str:
        """sha256 hex of `canonical()`: equal on every rank exactly when the plans are equal."""
        return hashlib.sha256(self.canonical().encode("ascii")).hexdigest()
