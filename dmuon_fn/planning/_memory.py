"""What a plan makes each rank hold between steps, and the byte balance of the schedule
(proofs/partition.md §11).

Resident bytes of slot s (one rank of the job; tensor parallelism: before its tensor split):
- masters: the fp32 master of every plan name it owns (4 bytes an element);
- states: Muon's momentum (4 bytes an element) of its matrices, AdamW's two moments (8) of its
  elementwise parameters, fp32;
- copies: under HSDP, the full copy every other replica's local owner keeps of each name, in the
  gather dtype (`copy_bytes` an element), on the slot of the same shard column in that replica.

`rebalance` moves or swaps whole units (a matrix, or a layer's elementwise parameters) from the
slot holding the most resident bytes to lighter ones, never raising any slot's Newton-Schulz
load above the schedule's busiest: the seconds bound is kept, the bytes are evened out."""

from __future__ import annotations

import bisect
import heapq
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

MASTER_BYTES = 4  # an fp32 master element
STATE_BYTES = {True: 4, False: 8}  # per element: Muon momentum (matrix), AdamW's two moments
_ROUNDS = 4  # moves or swaps tried per slot, at most
BALANCED = 1.10  # busiest / mean resident bytes a plan aims at
LOAD_TOLERANCE = 0.03  # how much heavier a plan's busiest load may be, to be that balanced


def element_bytes(matrix: bool) -> int:
    """Resident bytes per element of a parameter its global owner holds (master and state)."""
    return MASTER_BYTES + STATE_BYTES[matrix]


@dataclass(frozen=True)
class Resident:
    """Per slot: bytes of masters, optimizer states and HSDP copies (see the module doc)."""

    masters: tuple[int, ...]
    states: tuple[int, ...]
    copies: tuple[int, ...]

    @property
    def total(self) -> tuple[int, ...]:
        return tuple(map(sum, zip(self.masters, self.states, self.copies, strict=True)))

    @property
    def imbalance(self) -> float:
        """Busiest slot's resident bytes / the mean slot's (1.0 when nothing is held)."""
        t = self.total
        mean = sum(t) / len(t)
        return max(t) / mean if mean else 1.0


def resident(plan, copy_bytes: int = MASTER_BYTES) -> Resident:
    """`Resident` of a `Plan` (its names, shapes, slots, matrix flags and sizes)."""
    W, G = plan.world_size, plan.shard_size
    masters, states, copies = [0] * W, [0] * W, [0] * W
    for sh, s, m in zip(plan.shapes, plan.slots, plan.matrix, strict=True):
        n = math.prod(sh)
        masters[s] += MASTER_BYTES * n
        states[s] += STATE_BYTES[m] * n
        for r in range(plan.replicate_size):
            if r != s // G:
                copies[r * G + s % G] += copy_bytes * n
    return Resident(tuple(masters), tuple(states), tuple(copies))


def rebalance(
    slots: list[int],
    ns: Sequence[float],
    costs: Sequence[float],
    nbytes: Sequence[int],
    world_size: int,
    parents: Sequence[str | None],
    columns: int,
) -> list[int]:
    """`slots` (a slot per unit) with units moved, or pairs swapped, off the byte-heaviest slot
    while that lowers the largest of the two slots' resident bytes and keeps both slots' NS load
    (`ns`: per unit) and whole load (`costs`: the schedule's, bytes charged) at or below the
    schedule's busiest slot's: neither bound moves. `nbytes`: resident bytes per
    unit; `parents`: the sliced parameter a unit is a piece of (None: whole), whose pieces keep
    distinct shard columns (slot % columns). Deterministic: ties go to the lowest unit and
    slot."""
    slots = list(slots)
    load, held = [0.0] * world_size, [0] * world_size
    full = [0.0] * world_size
    on: list[set[int]] = [set() for _ in range(world_size)]
    cols: list[Counter] = [Counter() for _ in range(columns)]  # pieces' parents per column
    for u, s in enumerate(slots):
        load[s] += ns[u]
        full[s] += costs[u]
        held[s] += nbytes[u]
        on[s].add(u)
        cols[s % columns][parents[u]] += 1
    fit = _Fit(parents, cols, columns, costs, full, max(full) * (1 + 1e-12))
    bound = max(load) * (1 + 1e-12)
    heavy = [(-b, s) for s, b in enumerate(held)]
    heapq.heapify(heavy)
    light = sorted((b, s) for s, b in enumerate(held))  # (held, slot), lightest first
    for _ in range(_ROUNDS * world_size):
        while heavy and -heavy[0][0] != held[heavy[0][1]]:
            heapq.heappop(heavy)  # a stale entry
        if not heavy:
            break
        h = heavy[0][1]
        best = _best_change(h, on, load, held, ns, nbytes, fit, light, bound)
        if best is None:
            break
        _, t, i, j = best
        for s in (h, t):
            del light[bisect.bisect_left(light, (held[s], s))]
        for u, frm, to in ((i, h, t), (j, t, h)):
            if u is None:
                continue
            slots[u] = to
            cols[frm % columns][parents[u]] -= 1
            cols[to % columns][parents[u]] += 1
            on[frm].discard(u)
            on[to].add(u)
            load[frm] -= ns[u]
            load[to] += ns[u]
            full[frm] -= costs[u]
            full[to] += costs[u]
            held[frm] -= nbytes[u]
            held[to] += nbytes[u]
        for s in (h, t):
            heapq.heappush(heavy, (-held[s], s))
            bisect.insort(light, (held[s], s))
    return slots


@dataclass(frozen=True)
class _Fit:
    """Whether a unit may go to a slot: the slot's whole load stays within `bound`, and no other
    piece of a piece's parameter is in that column."""

    parents: Sequence[str | None]
    cols: list
    columns: int
    costs: Sequence[float]
    full: list[float]
    bound: float

    def ok(self, u: int, to: int, leaving: int | None = None) -> bool:
        """Unit u to slot `to` (`leaving`: a unit that goes the other way at the same time)."""
        back = 0.0 if leaving is None else self.costs[leaving]
        if self.full[to] + self.costs[u] - back > self.bound:
            return False
        p = self.parents[u]
        if p is None:
            return True
        here = self.cols[to % self.columns][p]
        return here == 0 or (here == 1 and leaving is not None and self.parents[leaving] == p)


def _best_change(h, on, load, held, ns, nbytes, fit, light, bound):
    """The move (unit i from h to t) or swap (i from h, j from t) that lowers max(held[h],
    held[t]) the most within the NS bound; among the 16 lightest slots. None if none helps."""
    best = None
    mine = sorted(i for i in on[h] if nbytes[i])
    for _, t in light[:16]:
        if t == h or held[t] >= held[h]:
            continue
        for i in mine:
            if load[t] + ns[i] <= bound and fit.ok(i, t):
                peak = max(held[h] - nbytes[i], held[t] + nbytes[i])
                if peak < held[h] and (best is None or peak < best[0]):
                    best = (peak, t, i, None)
            for j in sorted(on[t]):
                if nbytes[j] >= nbytes[i] or not (fit.ok(i, t, j) and fit.ok(j, h, i)):
                    continue
                if load[t] - ns[j] + ns[i] > bound or load[h] - ns[i] + ns[j] > bound:
                    continue
                d = nbytes[i] - nbytes[j]
                peak = max(held[h] - d, held[t] + d)
                if peak < held[h] and (best is None or peak < best[0]):
                    best = (peak, t, i, j)
    return best


def check_cap(plan, cap: int, plan_for) -> object:
    """`plan` if its busiest slot's resident bytes are at most `cap`; else a ValueError naming
    the smallest world size (a multiple of the replicate size) whose plan (`plan_for(w)`) fits,
    found by doubling then bisection (resident bytes fall as the world grows), or that none up
    to 64x does."""
    need = max(resident(plan).total)
    if need <= cap:
        return plan
    R, W = plan.replicate_size, plan.world_size

    def fits(w: int) -> bool:
        return max(resident(plan_for(w)).total) <= cap

    lo, hi = W, 2 * W
    while not fits(hi):
        if hi >= 64 * W:
            raise ValueError(
                f"max_bytes_per_rank={cap}: the busiest rank holds {need} bytes at world size "
                f"{W}, and no world size up to {hi} brings it under the cap (a parameter or piece "
                "that more ranks do not cut): raise the cap, or dedicate fewer parameters"
            )
        lo, hi = hi, 2 * hi
    klo, khi = lo // R, hi // R  # the smallest multiple of R in (lo, hi] that fits
    while khi - klo > 1:
        mid = (klo + khi) // 2
        klo, khi = (klo, mid) if fits(mid * R) else (mid, khi)
    hi = khi * R
    raise ValueError(
        f"max_bytes_per_rank={cap}: the busiest of {W} ranks would hold {need} bytes of "
        f"masters and optimizer states; the smallest world size that fits is {hi} ranks"
        f"{f' ({hi // R} per replica)' if R > 1 else ''}. Run on {hi} ranks or more, or raise "
        "the cap"
    )


def choose(plans: Sequence, balance_bytes: bool, heaviest):
    """The plan of `plans` with the lightest heaviest slots (`heaviest(loads)`: the largest
    loads in order; ties: the first); with `balance_bytes`, among those within LOAD_TOLERANCE
    of the lightest busiest load, the BALANCED ones (resident bytes) first, by their loads,
    then the others by their bytes."""
    if not balance_bytes:
        return min(plans, key=lambda p: heaviest(p.slot_loads))
    best = min(max(p.slot_loads) for p in plans)
    near = [p for p in plans if max(p.slot_loads) <= best * (1 + LOAD_TOLERANCE)]

    def key(p):  # balanced ones by their loads, the others by their bytes
        b = resident(p).imbalance
        return (0, heaviest(p.slot_loads)) if b <= BALANCED else (1, b)

    return min(near, key=key)
