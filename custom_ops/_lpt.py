"""Owner scheduling behind `dmuon::lpt_partition` and `dmuon_fn.partition`. Items have a cost, a
group (a layer; -1: none) and bytes; slot s of S = R·G is shard s % G of replica s // G. Steps:
1. LPT, 2. refine, 3. spread each group over the G columns, 4. balance column bytes; on exact
integers, deterministic in index order (proofs/custom_ops_notes.md, proofs/partition.md)."""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
from collections import Counter
from collections.abc import Sequence
from fractions import Fraction

_WIDTH = 16  # lightest slots (or columns) each refinement round tries against the heaviest
_COL_WIDTH = 2  # lightest shard columns each byte-balance round tries against the fullest
_TRIES = 8  # concrete (a, b) pairs tried per pair of interchangeable classes
_PAIR_CLASSES = 12  # two-item bundles only in slots of at most this many (cost, bytes) classes
SPREAD_TOLERANCE = 0.01  # makespan the spread schedule may cost over the refined plain one
BYTES_SLACK = Fraction(1, 100)  # step 4 stops with the fullest column this far above the mean

# (cost sum, bytes sum, item lists): 0-2 items of one slot, taken by (cost, bytes) class.
Bundle = tuple[int, int, tuple[list[int], ...]]


def exact(values: Sequence[float]) -> tuple[list[int], int]:
    """(q, den): integers q and a power of two den with values[i] == q[i] / den exactly."""
    ratios = [float(v).as_integer_ratio() for v in values]
    den = max((d for _, d in ratios), default=1)  # every denominator is a power of two
    return [p * (den // d) for p, d in ratios], den


def slot_loads(costs: Sequence[int], owners: Sequence[int], num_slots: int) -> list[int]:
    loads = [0] * num_slots
    for c, s in zip(costs, owners, strict=True):
        loads[s] += c
    return loads


def lpt(costs: Sequence[int], num_slots: int) -> list[int]:
    """Plain LPT (step 1): owners[i] in [0, num_slots)."""
    return _greedy(costs, num_slots, None)


class Spread:
    """Per-group caps and counts: ⌈k/G⌉ items of a k-item group per shard column, ⌈k/S⌉ per slot."""

    def __init__(self, groups: Sequence[int], num_slots: int, columns: int, owners=()) -> None:
        sizes = Counter(g for g in groups if g >= 0)
        self.groups, self.columns = groups, columns
        self.cap_col = {g: -(-k // columns) for g, k in sizes.items()}
        self.cap_slot = {g: -(-k // num_slots) for g, k in sizes.items()}
        self.col: Counter[tuple[int, int]] = Counter()
        self.slot: Counter[tuple[int, int]] = Counter()
        for i, s in enumerate(owners):  # counting an existing assignment
            self.add(i, s)

    def add(self, i: int, s: int, n: int = 1) -> None:
        g = self.groups[i]
        if g >= 0:
            self.slot[g, s] += n
            self.col[g, s % self.columns] += n

    def fits(self, i: int, dst: int) -> bool:
        """Whether unplaced item i may go to slot dst within the caps."""
        g = self.groups[i]
        return g < 0 or (
            self.slot[g, dst] < self.cap_slot[g]
            and self.col[g, dst % self.columns] < self.cap_col[g]
        )

    def over(self, i: int, s: int) -> bool:
        """Whether item i sits in slot s beyond its group's slot or column cap."""
        g = self.groups[i]
        return g >= 0 and (
            self.slot[g, s] > self.cap_slot[g] or self.col[g, s % self.columns] > self.cap_col[g]
        )

    def excess(self) -> int:
        over_slot = sum(max(0, k - self.cap_slot[g]) for (g, _), k in self.slot.items())
        over_col = sum(max(0, k - self.cap_col[g]) for (g, _), k in self.col.items())
        return over_slot + over_col


def _greedy(costs: Sequence[int], num_slots: int, spread: Spread | None) -> list[int]:
    """LPT, each item to the least loaded slot within its caps (there always is one)."""
    heap = [(0, s) for s in range(num_slots)]  # sorted, hence a heap
    owners = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        skipped = []
        load, s = heapq.heappop(heap)
        while spread is not None and not spread.fits(i, s):
            skipped.append((load, s))
            load, s = heapq.heappop(heap)
        owners[i] = s
        if spread is not None:
            spread.add(i, s)
        heapq.heappush(heap, (load + costs[i], s))
        for entry in skipped:
            heapq.heappush(heap, entry)
    return owners


class _State:
    """An assignment with its slot loads, members and column bytes. An exchange moves items A
    from slot src to dst and B from dst to src (|A| in 1..2, |B| in 0..2, |A| + |B| <= 3)."""

    def __init__(self, costs, nbytes, owners, num_slots, columns, spread) -> None:
        self.costs, self.nbytes, self.columns, self.spread = costs, nbytes, columns, spread
        self.owners = list(owners)
        self.loads = slot_loads(costs, owners, num_slots)
        self.col_bytes = [0] * columns
        self.members: list[set[int]] = [set() for _ in range(num_slots)]
        for i, s in enumerate(owners):
            self.members[s].add(i)
            self.col_bytes[s % columns] += nbytes[i]

    def half_gap(self, src: int, dst: int) -> int:  # the cost that evens the two slots out
        return (self.loads[src] - self.loads[dst]) // 2

    def bundles(self, s: int) -> list[Bundle]:
        classes: dict[tuple[int, int], list[int]] = {}
        for i in sorted(self.members[s]):
            classes.setdefault((self.costs[i], self.nbytes[i]), []).append(i)
        cls = list(classes.items())
        out = [(c, b, (xs,)) for (c, b), xs in cls]
        if len(cls) <= _PAIR_CLASSES:
            for j, ((c1, b1), x1) in enumerate(cls):
                for (c2, b2), x2 in cls[j:]:
                    if x1 is not x2 or len(x1) > 1:
                        out.append((c1 + c2, b1 + b2, (x1, x2)))
        return out

    def best(self, srcs, dsts, axis: int, center, score, strict: bool = False):
        """Lowest-scoring exchange (score, src, A, dst, B) or None; srcs: [(slot, bundles)]. B
        walks outward from A's cost (axis 0) or bytes (1) - center(src, dst), where `score` (None:
        skip) does not decrease. Never raises the spread excess (strict: lowers it)."""
        best = None
        for dst in dsts:
            bs = sorted([(0, 0, ()), *self.bundles(dst)], key=lambda x: (x[axis], x[:2]))
            vals = [x[axis] for x in bs]
            for src, src_bundles in srcs:
                if src == dst:
                    continue
                for a in src_bundles:
                    mid = bisect.bisect_left(vals, a[axis] - center(src, dst))
                    for side in (range(mid - 1, -1, -1), range(mid, len(bs))):
                        for k in side:
                            b = bs[k]
                            if len(a[2]) + len(b[2]) > 3:
                                continue
                            v = score(src, a, dst, b)
                            if v is None:
                                continue
                            if best is not None and v >= best[0]:
                                break
                            hit = self._concrete(src, a[2], dst, b[2], strict)
                            if hit is not None:
                                best = (v, src, hit[0], dst, hit[1])
                                break
        return best

    def _concrete(self, src, xa, dst, xb, strict):
        """The first items of the classes xa, xb whose exchange the caps allow."""
        for t, (A, B) in enumerate(itertools.product(_picks(xa), _picks(xb))):
            if t >= _TRIES:
                return None
            if self.spread is None or self._allowed(src, A, dst, B, strict):
                return A, B
        return None

    def _allowed(self, src, A, dst, B, strict) -> bool:
        """Whether the exchange keeps (strict: lowers) the spread excess of the counts it moves."""
        sp, cols = self.spread, self.columns
        delta: Counter[tuple[bool, int, int]] = Counter()  # (is column, group, slot or column)
        for items, frm, to in ((A, src, dst), (B, dst, src)):
            for i in items:
                g = sp.groups[i]
                if g >= 0:
                    delta[False, g, frm] -= 1
                    delta[False, g, to] += 1
                    delta[True, g, frm % cols] -= 1
                    delta[True, g, to % cols] += 1
        before = after = 0
        for (is_col, g, x), d in delta.items():
            counts, caps = (sp.col, sp.cap_col) if is_col else (sp.slot, sp.cap_slot)
            before += max(0, counts[g, x] - caps[g])
            after += max(0, counts[g, x] + d - caps[g])
        return after < before or (after == before and not strict)

    def apply(self, src: int, A, dst: int, B) -> None:
        for items, frm, to in ((A, src, dst), (B, dst, src)):
            for i in items:
                self.members[frm].discard(i)
                self.members[to].add(i)
                self.owners[i] = to
                self.loads[frm] -= self.costs[i]
                self.loads[to] += self.costs[i]
                self.col_bytes[frm % self.columns] -= self.nbytes[i]
                self.col_bytes[to % self.columns] += self.nbytes[i]
                if self.spread is not None:
                    self.spread.add(i, frm, -1)
                    self.spread.add(i, to)


def _picks(lists: tuple[list[int], ...]):
    """Distinct item tuples, one from each list (two from one list if it appears twice)."""
    if len(lists) == 2 and lists[0] is lists[1]:
        return itertools.combinations(lists[0], 2)
    return itertools.product(*lists)


def _lightest(values: Sequence[int], below: int) -> list[int]:
    idx = (j for j in range(len(values)) if values[j] < below)
    return heapq.nsmallest(_WIDTH, idx, key=lambda j: (values[j], j))


def refine(st: _State, max_rounds: int) -> None:
    """Step 2: each applied exchange lowers the sorted load vector, so it cannot cycle."""
    for _ in range(max_rounds):
        h = max(range(len(st.loads)), key=lambda s: (st.loads[s], -s))
        top = st.loads[h]

        def score(src, a, dst, b, top=top):
            d = a[0] - b[0]
            new = max(top - d, st.loads[dst] + d)
            return new if d > 0 and new < top else None

        best = st.best([(h, st.bundles(h))], _lightest(st.loads, top), 0, st.half_gap, score)
        if best is None:
            return
        st.apply(*best[1:])


def repair(st: _State, max_rounds: int) -> None:
    """Step 3A: move excess items out, keeping every slot <= the makespan; excess only falls."""
    sp, cap, cols = st.spread, max(st.loads), st.columns
    assert sp is not None
    stuck: set[int] = set()
    for _ in range(max_rounds):
        item = next((i for i, s in enumerate(st.owners) if i not in stuck and sp.over(i, s)), -1)
        if item < 0:
            return
        src, g = st.owners[item], sp.groups[item]
        col_over = sp.col[g, src % cols] > sp.cap_col[g]
        dsts = [s for s in range(len(st.loads)) if not (col_over and s % cols == src % cols)]

        def score(src, a, dst, b):
            d = a[0] - b[0]
            new = max(st.loads[src] - d, st.loads[dst] + d)
            return None if new > cap else new

        srcs = [(src, [(st.costs[item], st.nbytes[item], ([item],))])]
        best = st.best(srcs, dsts, 0, st.half_gap, score, strict=True)
        if best is None:
            stuck.add(item)
        else:
            st.apply(*best[1:])


def balance_bytes(st: _State, max_rounds: int) -> None:
    """Step 4: lowers the sorted column-bytes vector per exchange; loads stay <= the makespan."""
    cap, cols, S = max(st.loads), st.columns, len(st.loads)
    good_enough = (1 + BYTES_SLACK) * Fraction(sum(st.col_bytes), cols)
    for _ in range(max_rounds):
        hc = max(range(cols), key=lambda c: (st.col_bytes[c], -c))
        top = st.col_bytes[hc]
        if top <= good_enough:
            return

        def score(src, a, dst, b, top=top):
            d, dc = a[1] - b[1], a[0] - b[0]
            new = max(top - d, st.col_bytes[dst % cols] + d)
            ok = st.loads[src] - dc <= cap and st.loads[dst] + dc <= cap
            return new if ok and d > 0 and new < top else None

        def center(src, dst, top=top):
            return (top - st.col_bytes[dst % cols]) // 2

        srcs = [(s, st.bundles(s)) for s in range(hc, S, cols)]
        dsts = [s for c in _lightest(st.col_bytes, top)[:_COL_WIDTH] for s in range(c, S, cols)]
        best = st.best(srcs, dsts, 1, center, score)
        if best is None:
            return
        st.apply(*best[1:])


def spread_limit(q: Sequence[int], m0: int, m_a: int, S: int, tolerance: float) -> Fraction:
    """Largest makespan at which step 3 keeps schedule B: max(M0, min((1 + tolerance)·M_A,
    (4/3 − 1/(3S))·LB)), LB = max(total/S, p1, p_S + p_{S+1}) <= OPT, p sorted descending."""
    p = sorted(q, reverse=True)
    lb = max(Fraction(sum(p), S), Fraction(p[0] if p else 0))
    lb = max(lb, Fraction(p[S - 1] + p[S])) if len(p) > S else lb
    graham = Fraction(4 * S - 1, 3 * S) * lb
    return max(Fraction(m0), min((1 + Fraction(tolerance)) * m_a, graham))


def schedule(
    costs: Sequence[float],
    num_slots: int,
    *,
    groups: Sequence[int] | None = None,
    nbytes: Sequence[float] | None = None,
    replicate: int = 1,
    refined: bool = True,
    spread_tolerance: float = SPREAD_TOLERANCE,
) -> list[int]:
    """Owner slot in [0, num_slots) of each item: steps 1-4 (`refined=False`: step 1 only).
    costs, nbytes: finite and >= 0; groups: a group id >= 0 or -1 per item."""
    n = len(costs)
    if num_slots < 1 or replicate < 1 or num_slots % replicate:
        raise ValueError(
            f"need num_slots >= 1 divisible by replicate >= 1, got {num_slots} and {replicate}"
        )
    groups = [-1] * n if groups is None else [int(g) for g in groups]
    for name, seq in (("groups", groups), ("nbytes", nbytes or [0] * n)):
        if len(seq) != n:
            raise ValueError(f"{name} has {len(seq)} entries for {n} costs")
    reals = {"costs": costs, "nbytes": nbytes or (), "spread_tolerance": [spread_tolerance]}
    for name, seq in reals.items():
        if any(not 0 <= v < math.inf for v in seq):
            raise ValueError(f"{name} must be finite and >= 0")
    q, _ = exact(costs)
    qb = [0] * n if nbytes is None else exact(nbytes)[0]
    base = lpt(q, num_slots)
    if not refined or n == 0:
        return base
    rounds, cols = 4 * n + num_slots, num_slots // replicate

    def state(owners, spread):
        return _State(q, qb, owners, num_slots, cols, spread)

    st = state(base, None)
    refine(st, rounds)
    if any(g >= 0 for g in groups):
        m_a = max(st.loads)
        sp_b = Spread(groups, num_slots, cols)
        st_b = state(_greedy(q, num_slots, sp_b), sp_b)
        refine(st_b, rounds)
        if max(st_b.loads) <= m_a:  # no excess and no slower: nothing to weigh
            st = st_b
        else:
            sp_a = Spread(groups, num_slots, cols, st.owners)
            st = state(st.owners, sp_a)
            repair(st, rounds)
            m0 = max(slot_loads(q, base, num_slots))
            limit = spread_limit(q, m0, m_a, num_slots, spread_tolerance)
            if sp_a.excess() > 0 and max(st_b.loads) <= limit:
                st = st_b
    if nbytes is not None:
        balance_bytes(st, rounds)
    return st.owners
