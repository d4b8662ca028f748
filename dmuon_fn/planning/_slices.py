"""Slices: a batch of matrices (MoE experts) too costly for one owner is cut along its leading
dim into pieces `name[a:b]`, each planned as a parameter of its own; the pieces of one parameter
sit on distinct shard columns, so a rank holds at most one of them (proofs/partition.md §9).
A team (proofs/partition.md §10) is one matrix too costly for one owner, cut along its long side
into pieces `name[a:b]` (rows) or `name[:, a:b]` (columns) whose owners run its Newton-Schulz
together (`orthogonalize_team`), all in one replica."""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
import re
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

import torch

from ..ns._blocks import Blocks
from ..ns._team import Team
from ._memory import element_bytes

_PIECE = re.compile(
    r"(.+)\[((?::, )*)(?:(0|[1-9][0-9]*):([1-9][0-9]*), )?(0|[1-9][0-9]*):([1-9][0-9]*)\]"
)


class Piece(NamedTuple):
    param: str
    start: int
    stop: int
    dim: int  # the parameter's dim it is cut along
    # a piece of one batch piece (§12: rows of one expert): its [a, b) of dim 0 (dim is 1)
    outer: tuple[int, int] | None = None

    @property
    def index(self) -> tuple[slice, ...]:
        """What the piece is of its parameter, as an index (`param_tensor[piece.index]`)."""
        lead = (slice(None),) * self.dim if self.outer is None else (slice(*self.outer),)
        return (*lead, slice(self.start, self.stop))

    @property
    def offsets(self) -> tuple[int, ...]:
        """Where the piece starts along its parameter's dims up to its cut dim."""
        return tuple(s.start or 0 for s in self.index)


def piece_name(
    name: str, start: int, stop: int, dim: int = 0, outer: tuple[int, int] | None = None
) -> str:
    """The plan's name of [start, stop) of `name`'s dim `dim`: `name[a:b]`, `name[:, a:b]`...;
    `outer` (dim 1 only): within [a, b) of dim 0, `name[e0:e1, a:b]`."""
    if outer is not None:
        if dim != 1:
            raise ValueError(f"a piece within a dim-0 range is cut along dim 1, not {dim}")
        return f"{name}[{outer[0]}:{outer[1]}, {start}:{stop}]"
    return f"{name}[{':, ' * dim}{start}:{stop}]"


def parse_piece(piece: str) -> Piece:
    """(parameter, start, stop, dim, outer) of a piece name; ValueError for another name."""
    m = _PIECE.fullmatch(piece)
    if m is None or (m.group(2) and m.group(3) is not None):
        raise ValueError(
            f"{piece!r} is not a piece name 'param[start:stop]', 'param[:, a:b]' or "
            "'param[e0:e1, a:b]'"
        )
    if m.group(3) is not None:
        outer = (int(m.group(3)), int(m.group(4)))
        return Piece(m.group(1), int(m.group(5)), int(m.group(6)), 1, outer)
    return Piece(m.group(1), int(m.group(5)), int(m.group(6)), len(m.group(2)) // 3)


def take(value, piece: str):
    """What piece `piece` (its plan name) is of its parameter's `value`: a view."""
    return value[parse_piece(piece).index]


def join(pieces: Sequence[str], values: Sequence):
    """A parameter from its pieces' `values` in order (`pieces`: their plan names, all of it):
    the pieces of one batch piece concatenated along dim 1, then all along their cut dim."""
    if len(values) == 1:
        return values[0]
    cuts = [parse_piece(p) for p in pieces]
    runs: list[tuple[tuple[int, int] | None, list]] = []
    for c, v in zip(cuts, values, strict=True):
        if c.outer is not None and runs and runs[-1][0] == c.outer:
            runs[-1][1].append(v)
        else:
            runs.append((c.outer, [v]))
    parts = [torch.cat(vs, 1) if o is not None else vs[0] for o, vs in runs]
    dim = 0 if any(c.outer is not None for c in cuts) else cuts[0].dim
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


BYTE_PIECES = 4  # a batch's pieces hold at most about 1/4 of a slot's fair share of bytes


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


def make_team(plan, name: str, groups: Mapping[str, tuple]) -> Team | None:
    """What plan name `name` (this rank's piece or parameter) passes `muon_update`, from this
    rank's `groups` ({key: (group, the group rank of each piece)}, `comm.team_groups`; key: a
    team's matrix, a gathered group's first piece): the Team of its team, or of its gathered
    group (with its team as `inner` if it is a team member's slice), else None."""
    m = _PIECE.fullmatch(name)
    param = name if m is None else m.group(1)
    g = plan.gathered_group(name)
    member = None
    if param in plan.teams:  # a member's slice, or a gathered piece of one (None off the members)
        shape, dim = covered(plan, plan.pieces(param))
        member = Team(groups.get(param, (None,))[0] if g else groups[param][0], shape, dim - 2)
    if not g:
        return member
    shape, dim = covered(plan, g)
    cuts = tuple(p.stop - p.start for p in map(parse_piece, g))
    return Team(groups[g[0]][0], shape, dim, cuts, groups[g[0]][1], member)


def covered(plan, pieces: Sequence[str]) -> tuple[tuple[int, ...], int]:
    """(shape, the dim they are cut along) of what consecutive `pieces` cover together."""
    first, last = parse_piece(pieces[0]), parse_piece(pieces[-1])
    whole = list(plan.shape(pieces[0]))
    whole[first.dim] = last.stop - first.start
    return tuple(whole), first.dim


def team_cuts(shape: Sequence[int], k: int) -> tuple[int, list[int]]:
    """(dim, boundaries) of a team of `k` over one matrix of `shape` (2-D): its long dim (rows on
    ties) cut into k near-equal slices."""
    dim = 0 if shape[0] >= shape[1] else 1
    q, r = divmod(shape[dim], k)
    return dim, [j * q + min(j, r) for j in range(k + 1)]


def slice_rows(
    columns_of, world_size: int, columns: int, teams, per_share: int, member, by_bytes: bool = True
):
    """(rows, sliced, member_of) of a plan's parameters (`columns_of`: names, shapes, matrix,
    specs, one-owner costs): batches past a fair share cut into pieces of about 1/`per_share`
    of a share (`cuts`), matrices past it on teams (`team_cuts`, sizes by `best_sizing`, a
    member costing `member(shape, share, k)`), `teams` ({name: k}) as asked; `by_bytes`: batches
    also cut into pieces of at most about 1/BYTE_PIECES of a slot's fair share of resident bytes
    (planning/_memory.py). rows: (plan name,
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
    # a batch's cut into pieces (boundaries along its dim 0): by its cost, or finer where its
    # resident bytes would be more than 1/BYTE_PIECES of a slot's fair share of them
    held = [math.prod(sh) * element_bytes(m) for sh, m in zip(shapes, matrix, strict=True)]
    byte_share = math.fsum(held) / world_size / BYTE_PIECES if by_bytes else math.inf
    batches = {
        i: max(
            cuts(c, mean, sh[0], columns, per_share),
            cuts(held[i], byte_share, sh[0], columns, 1),
            key=len,
        )
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
    chosen = {}
    if big:
        sizes = _TeamSizes([(shapes[i], costs[i]) for i in big], columns, member)
        ks, _ = best_sizing(sizes, rest, world_size)
        chosen = {i: team_cuts(shapes[i], ks[tuple(shapes[i])]) for i in big}
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
        out[i] = one if k == 1 else team_cuts(shapes[i], k)
    return out


class _TeamSizes:
    """The team sizings of the costly matrices `big` ((shape, one-owner cost) each, 2-D) that
    `partition` weighs: for a member cost cap, each matrix on the least team (1: its one owner)
    whose members cost at most it (a member's cost `member(shape, share, k)`, the largest
    slice's; past every team's cost, the cheapest team). Only the caps where some matrix's team
    changes give new sizings, so every one is weighed."""

    def __init__(self, big, columns: int, member: Callable[..., float]) -> None:
        self.count = Counter(tuple(sh) for sh, _ in big)
        self.one = {tuple(sh): c for sh, c in big}
        self.member = member
        self.ladders: dict[tuple[int, ...], tuple[list[int], list[float]]] = {}
        for sh in self.count:  # the sizes where a cheaper member appears, and its cost
            ks, caps = [1], [-self.one[sh]]  # ascending: bisect finds the least k that fits
            for k in range(2, min(max(sh), columns) + 1):
                c = member(sh, -(-max(sh) // k), k)
                if c < -caps[-1]:
                    ks.append(k)
                    caps.append(-c)
            self.ladders[sh] = (ks, caps)

    def _sizing(self, cap: float) -> dict[tuple[int, ...], int]:
        return {
            sh: ks[min(bisect.bisect_left(caps, -cap), len(ks) - 1)]
            for sh, (ks, caps) in self.ladders.items()
        }

    def _members(self, sh: tuple[int, ...], k: int) -> list[tuple[float, int]]:
        """(member cost, how many) of one matrix of `sh` on a team of k (1: its one owner)."""
        if k == 1:
            return [(self.one[sh], 1)]
        q, r = divmod(max(sh), k)
        return [(self.member(sh, q + 1, k), r), (self.member(sh, q, k), k - r)]

    def ranked(self, rest: list[float], world_size: int):
        """(lower bound, sizing) of every distinct sizing, lowest bound first: the largest cost
        and the mean load, which no placement's busiest slot lies below."""
        caps = sorted({-c for _, cs in self.ladders.values() for c in cs}, reverse=True)
        top, total = (rest[0] if rest else 0.0), math.fsum(rest)
        out, seen = [], set()
        for cap in caps:
            ks = self._sizing(cap)
            key = tuple(sorted(ks.items()))
            if key in seen:
                continue
            seen.add(key)
            parts = [
                (c, n * self.count[sh]) for sh, k in ks.items() for c, n in self._members(sh, k)
            ]
            load = math.fsum(c * n for c, n in parts)
            largest = max((c for c, n in parts if n), default=0.0)
            out.append((max(top, largest, (total + load) / world_size), ks))
        return sorted(out, key=lambda p: p[0])

    def items(self, ks: dict[tuple[int, ...], int]) -> list[float]:
        """Every member's cost under sizing `ks`, largest first."""
        out = []
        for sh, k in ks.items():
            for c, n in self._members(sh, k):
                out += [c] * (n * self.count[sh])
        return sorted(out, reverse=True)


def best_sizing(sizes: _TeamSizes, rest: list[float], world_size: int):
    """(sizing, loads) of the sizing of `sizes` whose plain LPT with `rest` (largest first) has
    the lightest heaviest slots (`_lpt`; ties: the lowest bound first). Sizings go in order of
    their lower bound, scheduled while it and the pairing bound can still beat the best so
    far (proofs/partition.md §10)."""
    chosen, best = None, ()
    for bound, ks in sizes.ranked(rest, world_size):
        if best and bound > best[0]:
            break
        items = sizes.items(ks)
        if best and _pair_bound(items, rest, world_size) > best[0]:
            continue
        loads = _lpt(items, rest, world_size)
        if not best or loads < best:
            chosen, best = ks, loads
    return chosen, best


def _pair_bound(items: list[float], rest: list[float], world_size: int) -> float:
    """A lower bound on the busiest slot of any placement of `items` and `rest` (both largest
    first) on `world_size` slots: of the world_size + 1 largest, two share a slot."""
    if len(items) + len(rest) <= world_size:
        return 0.0
    top = list(itertools.islice(heapq.merge(items, rest, reverse=True), world_size + 1))
    return top[-2] + top[-1]


def _lpt(items: list[float], rest: list[float], world_size: int) -> tuple[float, ...]:
    """The heaviest `_COMPARED` slot loads, heaviest first, of a plain LPT of `items` and `rest`
    (both largest first): compared as tuples, the busiest slot decides and, where one parameter
    alone sets it (an embedding's bytes), the next."""
    slots = [0.0] * world_size  # a min-heap of slot loads
    for c in heapq.merge(items, rest, reverse=True):
        heapq.heapreplace(slots, slots[0] + c)
    return heaviest(slots)


_COMPARED = 4  # the heaviest slots plans compare


def heaviest(loads) -> tuple[float, ...]:
    """The `_COMPARED` heaviest of `loads`, heaviest first: plans compare as these tuples (the
    busiest slot decides; where one parameter alone sets it, the next slots)."""
    return tuple(heapq.nlargest(_COMPARED, loads))


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
