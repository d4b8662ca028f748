"""Slices: a batch of matrices (MoE experts) too costly for one owner is cut along its leading
dim into pieces `name[a:b]`, each planned as a parameter of its own; the pieces of one parameter
sit on distinct shard columns, so a rank holds at most one of them (proofs/partition.md §9).
A team (proofs/partition.md §10) is one matrix too costly for one owner, cut along its long side
into pieces `name[a:b]` (rows) or `name[:, a:b]` (columns) whose owners run its Newton-Schulz
together (`orthogonalize_team`), all in one replica."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from typing import NamedTuple

_PIECE = re.compile(r"(.+)\[((?::, )*)(0|[1-9][0-9]*):([1-9][0-9]*)\]")


class Piece(NamedTuple):
    param: str
    start: int
    stop: int
    dim: int  # the parameter's dim it is cut along


def piece_name(name: str, start: int, stop: int, dim: int = 0) -> str:
    """The plan's name of [start, stop) of `name`'s dim `dim`: `name[a:b]`, `name[:, a:b]`..."""
    return f"{name}[{':, ' * dim}{start}:{stop}]"


def parse_piece(piece: str) -> Piece:
    """(parameter, start, stop, dim) of a piece name; ValueError for another name."""
    m = _PIECE.fullmatch(piece)
    if m is None:
        raise ValueError(f"{piece!r} is not a piece name 'param[start:stop]' or 'param[:, a:b]'")
    return Piece(m.group(1), int(m.group(3)), int(m.group(4)), len(m.group(2)) // 3)


def cuts(cost: float, mean: float, length: int, columns: int, per_share: int = 2) -> list[int]:
    """Boundaries [0, ..., length] of a batch of `length` matrices costing `cost` when a slot's
    fair share is `mean`: past a fair share, k = min(length, columns, ⌈per_share·cost / mean⌉)
    near-equal pieces (about 1/per_share of a share each: halves or quarters pack with the
    other units where pieces of a whole share would not); else the whole parameter."""
    if not 0 < mean < cost:
        return [0, length]
    most = min(length, columns)
    k = most if cost >= most * mean / per_share else math.ceil(per_share * cost / mean)
    q, r = divmod(length, k)
    return [j * q + min(j, r) for j in range(k + 1)]


def team_cuts(
    shape: Sequence[int], unit: float, columns: int, member_cost: Callable[[int, int], float]
) -> tuple[int, list[int]]:
    """(dim, boundaries) of a team for one matrix of `shape` (2-D): its long dim (rows on ties)
    cut into k near-equal slices, k >= 2 the least team whose members each cost at most `unit`
    (`member_cost(share, k)`: the largest slice's), else the most, min(columns, long side);
    (0, [0, rows]) when no team of 2 fits (a single column, or a side of 1)."""
    dim = 0 if shape[0] >= shape[1] else 1
    long = shape[dim]
    most = min(long, columns)
    if most < 2:
        return 0, [0, shape[0]]
    fits = (j for j in range(2, most) if member_cost(-(-long // j), j) <= unit)
    k = next(fits, most)
    q, r = divmod(long, k)
    return dim, [j * q + min(j, r) for j in range(k + 1)]


def spread_columns(
    pieces: Sequence[Sequence[int]],
    slots: list[int],
    costs: Sequence[float],
    num_slots: int,
    columns: int,
    teams: Sequence[bool] = (),
) -> None:
    """Move pieces (indices into `slots`, one list per sliced parameter) so that each list's
    pieces sit on distinct shard columns (slot % columns), a team's also in its first piece's
    replica (slot // columns): a piece whose place is taken moves to the least-loaded free slot
    (lowest slot on ties). In place; a list holds at most `columns` pieces."""
    loads = [0.0] * num_slots
    for c, s in zip(costs, slots, strict=True):
        loads[s] += c
    for j, idx in enumerate(pieces):
        used: set[int] = set()
        home = slots[idx[0]] // columns if j < len(teams) and teams[j] else None
        for i in idx:
            if slots[i] % columns in used or home not in (None, slots[i] // columns):
                free = [
                    t
                    for t in range(num_slots)
                    if t % columns not in used and home in (None, t // columns)
                ]
                dst = min(free, key=lambda t: (loads[t], t))
                loads[slots[i]] -= costs[i]
                loads[dst] += costs[i]
                slots[i] = dst
            used.add(slots[i] % columns)
