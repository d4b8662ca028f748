"""What `orthogonalize` runs for a shape (`ns_method`) and what the planner charges (`ns_flops`)."""

from __future__ import annotations

import math
from collections.abc import Collection

# `auto` runs Gram NS from long/short >= GRAM_MIN_ASPECT (GPU; a CPU's is measured) with a short
# side >= GRAM_MIN_SHORT (below it low-precision Gram can diverge; a CPU measures where Gram starts
# to pay, never below it). Why: proofs/ns_notes.md.
GRAM_MIN_ASPECT = 1.5
GRAM_MIN_SHORT = 32


def default_restarts(steps: int) -> tuple[int, ...]:
    """Gram NS restart steps: every second step ((2, 4) for 5 steps; proofs/ns_notes.md)."""
    return tuple(range(2, steps, 2))


def ns_method(
    shape: tuple[int, ...] | list[int],
    method: str = "auto",
    min_aspect: float = GRAM_MIN_ASPECT,
    min_short: int = GRAM_MIN_SHORT,
) -> str:
    """ "gram" or "standard" for a matrix of `shape` (trailing two dims; leading dims batch):
    "auto" picks Gram from long/short >= `min_aspect` (inf: never) with a short side >=
    `min_short` (never below GRAM_MIN_SHORT)."""
    if method not in ("auto", "gram", "standard"):
        raise ValueError(f"method must be 'auto', 'gram' or 'standard', got {method!r}")
    if method != "auto":
        return method
    rows, cols = shape[-2], shape[-1]
    short, long = min(rows, cols), max(rows, cols)
    wide_enough = long >= min_aspect * short
    return "gram" if wide_enough and short >= max(min_short, GRAM_MIN_SHORT) else "standard"


def ns_flops(
    shape: tuple[int, ...] | list[int],
    *,
    steps: int = 5,
    method: str = "auto",
    restarts: Collection[int] | None = None,
    sym_discount: float = 0.5,
    min_aspect: float = GRAM_MIN_ASPECT,
    min_short: int = GRAM_MIN_SHORT,
) -> float:
    """FLOPs (2 per multiply-add) of orthogonalizing `shape` (leading dims: a batch); a symmetric
    product costs `sym_discount` of the full GEMM (0.5: ideal SYRK); `min_aspect`, `min_short` as
    `ns_method`."""
    rows, cols = shape[-2], shape[-1]
    batch = math.prod(shape[:-2])
    n, m = min(rows, cols), max(rows, cols)
    sym_nm = 2.0 * n * n * m * sym_discount  # X·Xᵀ
    sym_nn = 2.0 * n**3 * sym_discount  # product of two commuting symmetric n×n matrices
    full_nm = 2.0 * n * n * m  # (n×n)·(n×m)
    if ns_method(shape, method, min_aspect, min_short) == "standard":
        return batch * steps * (sym_nm + sym_nn + full_nm)
    rs = set(default_restarts(steps) if restarts is None else restarts)
    total = 0.0
    for i in range(steps):
        first = i == 0 or i in rs
        last = i == steps - 1 or (i + 1) in rs
        if first:
            total += sym_nm + full_nm  # R = X·Xᵀ at the (re)start, Q·X when the segment ends
        total += sym_nn  # P = aI + bR + cR²
        total += 0.0 if first else sym_nn  # Q' = P·Q
        total += 0.0 if last else 2 * sym_nn  # R' = P·(P·R)
    return batch * total


def member_shape(shape: tuple[int, ...] | list[int], k: int) -> tuple[int, int]:
    """(m, share) a team of `k` chooses its form for, on one matrix of `shape` cut along its
    long side: the short side m and a member's share ⌈long/k⌉, a share below m counting as m
    (the Gram form's m×m iteration never shrinks)."""
    short, long = sorted(shape[-2:])
    return short, max(-(-long // k), short)


def team_form(
    shape: tuple[int, ...] | list[int],
    k: int,
    method: str = "auto",
    min_aspect: float = GRAM_MIN_ASPECT,
    min_short: int = GRAM_MIN_SHORT,
) -> str:
    """The form a team of `k` runs on one matrix of `shape` (`orthogonalize_team`'s choice)."""
    return ns_method(member_shape(shape, k), method, min_aspect, min_short)


def team_flops(
    shape: tuple[int, ...] | list[int],
    share: int,
    k: int,
    *,
    steps: int = 5,
    method: str = "auto",
    restarts: Collection[int] | None = None,
    sym_discount: float = 0.5,
    min_aspect: float = GRAM_MIN_ASPECT,
    min_short: int = GRAM_MIN_SHORT,
) -> float:
    """FLOPs one member of a team of `k` runs for its `share` of `shape`'s long side: the Gram
    form's m×m iteration whole on every member, the standard form's X_i·X_iᵀ and B·X_i on the
    share and a ⌈m/k⌉-row block of b·A + c·A² (proofs/team_ns.md claim 5)."""
    m = min(shape[-2:])
    form = team_form(shape, k, method, min_aspect, min_short)
    if form == "gram":
        return ns_flops(
            (m, share), steps=steps, method="gram", restarts=restarts, sym_discount=sym_discount
        )
    return steps * (2.0 * m * m * share * (sym_discount + 1.0) + 2.0 * -(-m // k) * m * m)


def team_bytes(
    shape: tuple[int, ...] | list[int],
    k: int,
    *,
    steps: int = 5,
    method: str = "auto",
    restarts: Collection[int] | None = None,
    min_aspect: float = GRAM_MIN_ASPECT,
    min_short: int = GRAM_MIN_SHORT,
    itemsize: int = 2,
) -> float:
    """Bytes a member of a team of `k` sends and receives per call, as `CommCounter` books them
    (ring all-reduce 2·(k-1)/k of its size, reduce-scatter (k-1)/k of its input, all-gather
    (k-1)/k of its output): the normalizing all-gather of 2 float64; per standard step or Gram
    (re)start the m×m Gram sum (fp32 iterates: an fp32 all-reduce; narrower, `itemsize` < 4: an
    fp32 reduce-scatter of ⌈m/k⌉-row blocks and their all-gather in the iteration dtype); and
    per standard step the all-gather of B's ⌈m/k⌉-row blocks in the iteration dtype."""
    m, share = min(shape[-2:]), (k - 1) / k
    rs = default_restarts(steps) if restarts is None else restarts
    standard = team_form(shape, k, method, min_aspect, min_short) == "standard"
    reduces = steps if standard else 1 + len(set(rs))
    blocks = k * -(-m // k) * m  # k blocks of ⌈m/k⌉ rows
    summed = 2 * itemsize * m * m if itemsize >= 4 else blocks * (4 + itemsize)
    gathered = 16 * k + (steps * blocks * itemsize if standard else 0)
    return share * (reduces * summed + gathered)
