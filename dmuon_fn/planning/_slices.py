"""Slices: a batch of matrices (MoE experts) too costly for one owner is cut along its leading
dim into pieces `name[a:b]`, each planned as a parameter of its own; the pieces of one parameter
sit on distinct shard columns, so a rank holds at most one of them (proofs/partition.md §9)."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

_PIECE = re.compile(r"(.+)\[(0|[1-9][0-9]*):([1-9][0-9]*)\]")


def piece_name(name: str, start: int, stop: int) -> str:
    """The plan's name of rows [start, stop) of `name`'s leading dim."""
    return f"{name}[{start}:{stop}]"


def parse_piece(piece: str) -> tuple[str, int, int]:
    """(parameter, start, stop) of a piece name; ValueError for another name."""
    m = _PIECE.fullmatch(piece)
    if m is None:
        raise ValueError(f"{piece!r} is not a piece name 'param[start:stop]'")
    return m.group(1), int(m.group(2)), int(m.group(3))


def cuts(cost: float, mean: float, length: int, columns: int) -> list[int]:
    """Boundaries [0, ..., length] of a batch of `length` matrices costing `cost` when a slot's
    fair share is `mean`: past a fair share, k = min(length, columns, ⌈2·cost / mean⌉)
    near-equal pieces (about half a share each: halves pack with the other units where pieces
    of a whole share would not); else the whole parameter, [0, length]."""
    if not 0 < mean < cost:
        return [0, length]
    most = min(length, columns)
    k = most if cost >= most * mean / 2 else math.ceil(2 * cost / mean)
    q, r = divmod(length, k)
    return [j * q + min(j, r) for j in range(k + 1)]


def spread_columns(
    pieces: Sequence[Sequence[int]],
    slots: list[int],
    costs: Sequence[float],
    num_slots: int,
    columns: int,
) -> None:
    """Move pieces (indices into `slots`, one list per sliced parameter) so that each list's
    pieces sit on distinct shard columns (slot % columns): a piece whose column is taken moves to
    the least-loaded slot of a free column (lowest slot on ties). In place; a list holds at most
    `columns` pieces."""
    loads = [0.0] * num_slots
    for c, s in zip(costs, slots, strict=True):
        loads[s] += c
    for idx in pieces:
        used: set[int] = set()
        for i in idx:
            if slots[i] % columns in used:
                free = [t for t in range(num_slots) if t % columns not in used]
                dst = min(free, key=lambda t: (loads[t], t))
                loads[slots[i]] -= costs[i]
                loads[dst] += costs[i]
                slots[i] = dst
            used.add(slots[i] % columns)
