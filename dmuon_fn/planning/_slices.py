"""Slices: a batch of matrices (MoE experts) too costly for one owner is cut along its leading
dim into pieces `name[a:b]`, each planned as a parameter of its own; the pieces of one parameter
sit on distinct shard columns, so a rank holds at most one of them (proofs/partition.md §9).
A team (proofs/partition.md §10) is one matrix too costly for one owner, cut along its long side
into pieces `name[a:b]` (rows) or `name[:, a:b]` (columns) whose owners run its Newton-Schulz
together (`orthogonalize_team`), all in one replica."""

from __future__ import annotations

import heapq
import itertools
import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

from ..ns._blocks import Blocks

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


def slice_rows(columns_of, world_size: int, columns: int, teams, per_share: int, member):
    """(rows, sliced, member_of) of a plan's parameters (`columns_of`: names, shapes, matrix,
    specs, one-owner costs): batches past a fair share cut into pieces of about 1/`per_share`
    of a share (`cuts`), matrices past it on teams (`team_cuts`, sizes by `_teams_for`, a
    member costing `member(shape, share, k)`), `teams` ({name: k}) as asked. rows: (plan name,
    shape, is matrix, spec) per piece or whole parameter, by name; sliced: {parameter: its
    pieces in order}; member_of: {a team's piece: (its matrix's shape, k)}."""
    names, shapes, matrix, specs, costs = columns_of
    mean = math.fsum(costs) / world_size
    asked = _asked(teams, names, shapes, specs, columns)  # k = 1: one owner
    big = [
        i
        for i, b in enumerate(specs)
        if b == Blocks() and costs[i] > mean and names[i] not in teams
    ]
    batches = {  # a batch's cut into pieces (boundaries along its dim 0)
        i: cuts(c, mean, sh[0], columns, per_share)
        for i, (sh, b, c) in enumerate(zip(shapes, specs, costs, strict=True))
        if b and b.batch
    }
    on_teams = set(big)
    rest = []  # the other parameters' costs (batches by their pieces), largest first
    for i, c in enumerate(costs):
        if i not in on_teams:
            at = batches.get(i, [0, 1])
            rest += [c * (z - a) / at[-1] for a, z in itertools.pairwise(at)]
    rest.sort(reverse=True)
    chosen, best = {}, ()
    # each unit's teams in order of their lower bound (no slot below the mean or the largest
    # cost), by LPT while that bound can still beat the best estimate so far
    plans = [_teams_for(shapes, costs, big, u, columns, member) for u in _units(mean, max(costs))]
    top, total = (rest[0] if rest else 0.0), math.fsum(rest)
    bounds = [max(top, *items[:1], (total + math.fsum(items)) / world_size) for items, _ in plans]
    ranked = sorted(zip(bounds, plans, strict=True), key=lambda p: p[0]) if big else []
    for bound, (items, teams_at) in ranked:
        if best and bound > best[0]:
            break
        loads = _lpt(items, rest, world_size)
        if not best or loads < best:
            chosen, best = teams_at, loads
    chosen |= {i: cut for i, cut in asked.items() if len(cut[1]) > 2}
    rows, sliced, member_of = [], {}, {}
    for i, (n, sh, m, b) in enumerate(zip(names, shapes, matrix, specs, strict=True)):
        dim, at = chosen.get(i, (0, batches.get(i, [0, 1])))
        if len(at) == 2:
            rows.append((n, sh, m, b))
            continue
        spans = list(itertools.pairwise(at))
        sliced[n] = tuple(piece_name(n, a, z, dim) for a, z in spans)
        for p, (a, z) in zip(sliced[n], spans, strict=True):
            rows.append((p, (*sh[:dim], z - a, *sh[dim + 1 :]), m, b))
            if not b.batch:
                member_of[p] = (sh, len(spans))
    return rows, sliced, member_of


def check_teams(teams: Mapping[str, int], columns: int, whole: bool) -> None:
    """ValueError for `teams` ({name: k}) a plan cannot honour: any team where every parameter
    stays whole (`whole`: slices off, or tensor parallelism), a team of 2+ on one shard column
    (each k is checked against its matrix in `slice_rows`)."""
    if teams and whole:
        raise ValueError("teams needs slices=True and no tensor parallelism (TP plans are whole)")
    if max(teams.values(), default=1) != 1 and columns < 2:
        raise ValueError("teams of 2 or more need 2 or more shard columns")


def _asked(teams, names, shapes, specs, columns) -> dict[int, tuple[int, list[int]]]:
    """{index: (dim, boundaries)} of the teams `teams` ({name: k}) asks for."""
    out = {}
    for n, k in teams.items():
        i = names.index(n) if n in names else -1
        ok = i >= 0 and specs[i] == Blocks() and isinstance(k, int) and 1 <= k <= columns
        if not ok or k > max(shapes[i]):
            raise ValueError(
                f"teams[{n!r}] = {k!r}: a team is 2..{columns} (the shard columns) owners of one "
                "matrix Muon updates (2-D, no blocks spec), at most its long side; 1: one owner"
            )
        one = (0, [0, shapes[i][0]])
        out[i] = one if k == 1 else team_cuts(shapes[i], 0.5, k + 1, lambda a, j, k=k: j != k)
    return out


def _units(mean: float, top: float) -> list[float]:
    """The member costs a plan's teams are tried at: from `top` (the largest matrix's) down to
    1/16 of a slot's fair share, by factors of √2."""
    out = [mean / 16]
    while out[-1] < top:
        out.append(out[-1] * math.sqrt(2))
    return out


def _teams_for(shapes, costs, big, unit, columns, member):
    """(the costs of the matrices `big`, largest first, {index: (dim, boundaries)}) with those
    matrices on teams whose members cost at most `unit` where they can (a member's cost is
    `member(shape, share, k)`; proofs/partition.md §10)."""
    out, items = {}, []
    seen: dict[tuple[int, ...], tuple[int, list[int], list[float]]] = {}
    for i in big:
        sh = shapes[i]
        if sh not in seen:
            dim, at = team_cuts(sh, unit, columns, lambda a, k, sh=sh: member(sh, a, k))
            k = len(at) - 1
            seen[sh] = (dim, at, [member(sh, b - a, k) for a, b in itertools.pairwise(at)])
        dim, at, members = seen[sh]
        if len(at) == 2:
            items.append(costs[i])
            continue
        out[i] = (dim, at)
        items += members
    return sorted(items, reverse=True), out


def _lpt(items: list[float], rest: list[float], world_size: int) -> tuple[float, ...]:
    """The heaviest `_COMPARED` slot loads, heaviest first, of a plain LPT of `items` and `rest`
    (both largest first): compared as tuples, the busiest slot decides and, where one parameter
    alone sets it (an embedding's bytes), the next."""
    slots = [0.0] * world_size  # a min-heap of slot loads
    for c in heapq.merge(items, rest, reverse=True):
        heapq.heapreplace(slots, slots[0] + c)
    return tuple(heapq.nlargest(_COMPARED, slots))


_COMPARED = 4  # the heaviest slots `_lpt` reports


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
