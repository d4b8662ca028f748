"""Gathered teams (proofs/partition.md §12): a matrix whose fp32 master and momentum leave its
owner holding more than BALANCED times the mean slot's resident bytes, with nothing lighter to
move (planning/_memory.py), is cut along dim 0 (a team member's slice: along its team's cut;
a single expert, (1, m, n): along its rows, pieces `name[e:e+1, a:b]`) into pieces held by the
lightest slots. Its Newton-Schulz stays where the schedule put it, on
the holder of the first piece, which gathers the momentum's pieces, orthogonalizes the whole as
one owner would (a slice: as its team's member) and sends each piece back
(`orthogonalize_gathered`): every slot's NS load is what it was; the step moves twice the
matrix's fp32 bytes more, through that holder."""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections import defaultdict
from collections.abc import Collection

from ._memory import BALANCED, MASTER_BYTES, element_bytes, resident
from ._slices import parse_piece, piece_name

_ROOM = 0.999  # of the bound a receiving slot may fill (rounding stays under it)
# the least resident bytes a piece other than the first holds: below, its all-to-all's time is
# its latency (256 KiB at 50 GB/s, one 400 Gb/s link, take about the 5 µs a message starts
# with), not its bytes (a module constant, so that a test of small models may lower it in its
# ranks)
MIN_PIECE_BYTES = 1 << 18
# how far over the busiest slot's whole load (NS and per-byte costs) the pieces' per-byte costs
# may take a slot: an expert-heavy plan's slots all sit at the busiest load to a fraction of
# one expert's bytes, which would leave no room for any piece
LOAD_SLACK = 1.02


def gather_pieces(plan, keep: Collection[str], flops_per_byte: float, bytes_per_elem: int):
    """`plan` with units cut into gathered groups until the busiest slot's resident bytes are
    at most BALANCED times the mean, or its heaviest unit cannot be cut (one index along its
    cut, a parameter in `keep`, or no room for its pieces); `plan` itself when no cut is
    needed. A unit is a whole matrix or a piece of a sliced batch, cut along dim 0 (a single
    expert along its rows, dim 1), or a team member's slice, cut along the dim its team's are:
    the first piece stays on its slot with all of the unit's Newton-Schulz, as many rows as fit
    under the bound; the others, of at least MIN_PIECE_BYTES each, go to the slots with the
    most room under it (their HSDP copies' too), on distinct shard columns no other piece of the
    parameter is on, none raising its whole load above LOAD_SLACK times the busiest slot's
    (`_place`)."""
    W, G = plan.world_size, plan.shard_size
    held = list(resident(plan).total)
    bound = BALANCED * sum(held) / W
    if G < 2 or max(held) <= bound:
        return plan
    loads, top = list(plan.slot_loads), LOAD_SLACK * max(plan.slot_loads)  # (the cap)
    parent = {p: n for n, ps in plan.sliced for p in ps}
    columns: dict[str, set[int]] = defaultdict(set)  # a parameter -> its pieces' columns
    layered: dict[str, set[int]] = defaultdict(set)  # a layer -> the columns of its matrices
    on: dict[int, list[int]] = defaultdict(list)
    dims = [0] * len(plan.names)  # the dim a unit is cut along: a team slice's, one expert's
    # rows (1), else 0
    for i, (n, s) in enumerate(zip(plan.names, plan.slots, strict=True)):
        columns[parent.get(n, n)].add(s % G)
        if plan.matrix[i]:
            layered[plan.layers[i]].add(s % G)
        if n in parent and parent[n] in plan.teams:
            dims[i] = parse_piece(n).dim
        elif len(plan.shapes[i]) == 3 and plan.shapes[i][0] == 1:  # one expert: by its rows
            dims[i] = 1
        if plan.matrix[i] and plan.shapes[i][dims[i]] > 1 and parent.get(n, n) not in keep:
            on[s].append(i)
    cut: dict[int, list[tuple[int, int, int]]] = {}  # unit index -> (start, stop, slot)s

    def add(slot: int, elems: int, sign: int) -> None:
        held[slot] += sign * element_bytes(True) * elems
        for r in range(plan.replicate_size):
            if r != slot // G:  # the HSDP copy on the same column of another replica
                held[r * G + slot % G] += sign * MASTER_BYTES * elems

    while True:
        s = max(range(W), key=lambda t: (held[t], -t))
        if held[s] <= bound or not on[s]:
            break
        i = max(on[s], key=lambda j: (math.prod(plan.shapes[j]), -j))
        on[s].remove(i)
        used = columns[parent.get(plan.names[i], plan.names[i])]
        length = plan.shapes[i][dims[i]]
        row = math.prod(plan.shapes[i]) // length  # elements per index of the cut dim
        per_row = flops_per_byte * bytes_per_elem * row
        spread = layered[plan.layers[i]]
        pieces = _place((length, row), s, held, bound, (used, spread, G), (loads, top, per_row))
        if pieces is None:
            continue
        add(s, length * row, -1)
        for a, b, t in pieces:
            add(t, (b - a) * row, 1)
            used.add(t % G)
            spread.add(t % G)
            if t != s:
                loads[t] += per_row * (b - a)
        cut[i] = pieces
    return _with_cuts(plan, cut, parent, dims, (flops_per_byte, bytes_per_elem)) if cut else plan


def _place(size, s, held, bound, columns, load):
    """[(start, stop, slot)] of a unit of `size` (length, elements per index) on slot s cut
    along its cut dim, or None when it does not lower s: s keeps the indices that fit under
    `bound`, the rest fill the slots of s's job with the most room (the HSDP copies its
    column's slots in other replicas would hold counted), as few as that takes: `columns`
    (used, spread, G): never a column in `used` (the parameter's), the columns not in
    `spread` (its layer's matrices') first (§4: a layer's gathers from distinct ranks);
    `load`: (loads, top, cost per index), the indices a slot's whole load allows."""
    used, spread, G = columns
    length, row = size[0], element_bytes(True) * size[1]
    least = max(1, math.ceil(MIN_PIECE_BYTES / row))  # indices
    rest = held[s] - row * length  # s without the unit
    mine = max(1, min(length, math.floor((_ROOM * bound - rest) / row)))
    loads, top, per_row = load
    rooms = []
    for t in range(len(held)):
        if t % G in used:
            continue
        fit = math.floor((_ROOM * bound - held[t]) / row)
        for c in range(t % G, len(held), G):  # the HSDP copies on its column (MASTER_BYTES)
            if c != t:
                fit = min(
                    fit,
                    math.floor(
                        (_ROOM * bound - held[c]) / (row * MASTER_BYTES / element_bytes(True))
                    ),
                )
        if per_row > 0:
            fit = min(fit, math.floor((top - loads[t]) / per_row))
        if fit >= least:
            rooms.append((t % G in spread, -fit, t))
    rooms.sort()
    counts, left, taken = [], length - mine, set()
    for _, fit, t in rooms:
        if left < least:  # (none left, or too few for a piece: the first keeps them)
            break
        if t % G in taken:  # (another replica's slot of a column this cut already has)
            continue
        taken.add(t % G)
        counts.append((min(left, -fit), t))
        left -= counts[-1][0]
    if not counts:
        return None
    counts.insert(0, (mine + left, s))  # not room enough: s keeps the rest (still lighter)
    edges = list(itertools.accumulate((n for n, _ in counts), initial=0))
    return [(a, b, t) for a, b, (_, t) in zip(edges, edges[1:], counts, strict=False)]


def _with_cuts(plan, cut, parent, dims, per_byte: tuple[float, int]):
    """`plan` with each cut unit replaced by its pieces along its dim in `dims` (a batch
    piece's or a team slice's, among its parameter's pieces in order), each cut a gathered
    group, its first piece first (all the unit's NS FLOPs and team bytes on it)."""
    flops_per_byte, bytes_per_elem = per_byte
    cols = ("names", "shapes", "slots", "layers", "matrix", "costs", "nbytes", "ns_flops")
    cols += tuple(c for c in ("blocks", "team_bytes") if getattr(plan, c))
    rows = [
        dict(zip(cols, r, strict=True)) for r in zip(*map(plan.__getattribute__, cols), strict=True)
    ]
    out, sliced, groups = [], dict(plan.sliced), list(plan.gathered)
    for i, r in enumerate(rows):
        if i not in cut:
            out.append(r)
            continue
        name, d, sh = r["names"], dims[i], r["shapes"]
        param, own = parent.get(name, name), parse_piece(name) if name in parent else None
        base, outer = 0, None  # where the unit starts along d; one expert's dim-0 index
        if own is not None and own.dim == d:
            base = own.start
        elif d == 1 and len(sh) == 3:
            outer = (own.start, own.stop) if own is not None else (0, 1)
        row = math.prod(sh) // sh[d]
        group = []
        for j, (a, b, t) in enumerate(cut[i]):
            group.append(piece_name(param, base + a, base + b, d, outer))
            n = (b - a) * row
            held = {  # a piece other than the first: its bytes' cost only
                "costs": flops_per_byte * bytes_per_elem * n,
                "ns_flops": 0.0,
                **({"team_bytes": 0.0} if "team_bytes" in r else {}),
            }
            out.append(
                {
                    **r,
                    **(held if j else {}),
                    "names": group[-1],
                    "shapes": (*sh[:d], b - a, *sh[d + 1 :]),
                    "slots": t,
                    "nbytes": bytes_per_elem * n,
                }
            )
        ps = sliced.get(param, (param,))
        k = ps.index(name)
        sliced[param] = (*ps[:k], *group, *ps[k + 1 :])
        groups.append(tuple(group))
    out.sort(key=lambda r: r["names"])
    loads: list[list[float]] = [[] for _ in range(plan.world_size)]
    sums = [0] * plan.world_size
    for r in out:
        loads[r["slots"]].append(r["costs"])
        sums[r["slots"]] += r["nbytes"]
    return dataclasses.replace(
        plan,
        **{c: tuple(r[c] for r in out) for c in cols},
        slot_loads=tuple(math.fsum(x) for x in loads),
        slot_bytes=tuple(sums),
        sliced=tuple(sorted(sliced.items())),
        gathered=tuple(sorted(groups)),
    )
