"""The text of a `PlanSummary` (`str(summary)`): the job's totals, its teams, gathered groups
and resident bytes, then a row per rank (a selection of them in a large job). Each function
takes the summary `s` (planning/_summary.py, which imports this module: no import back)."""

from __future__ import annotations

import math

_FULL_TABLE = 24  # slots shown in full up to this many; larger jobs show a selection
_EDGE, _BUSIEST, _LEAST = 3, 4, 2  # first/last, busiest and least loaded slots then shown
_NAME_WIDTH = 40


def _scaled(x: float, unit: str, binary: bool = False) -> tuple[float, str]:
    """(divisor, label) putting `x` in [1, 1000) with an SI prefix, or [1, 1024) with KiB, MiB..."""
    prefixes = ["", *(p + "i" for p in "KMGTP")] if binary else ["", *"kMGTPE"]
    base, k = 1024.0 if binary else 1000.0, 0
    while k + 1 < len(prefixes) and abs(x) >= base ** (k + 1):
        k += 1
    return base**k, prefixes[k] + unit


def _seconds(t: float) -> str:
    return f"{t:.3g} s" if t >= 1 else f"{t * 1e3:.3g} ms"


def _team_lines(s) -> list[str]:
    """The teams: how many, their members, their extra work and their collectives."""
    name, k, _, _ = max(s.teams, key=lambda t: t[1])
    together, alone = (math.fsum(t[i] for t in s.teams) for i in (2, 3))
    comm = max(r.team_bytes for r in s.slots)
    cdiv, cunit = _scaled(comm, "B", binary=True)
    name = name if len(name) <= _NAME_WIDTH else "..." + name[3 - _NAME_WIDTH :]
    return [
        f"teams: {len(s.teams)} matrices on {sum(t[1] for t in s.teams)} members (the most: "
        f"{k} for {name})",
        f"  their Newton-Schulz: {together / alone:.2f}x one owner's FLOPs; their collectives: "
        f"up to {comm / cdiv:.4g} {cunit} per rank and step",
    ]


def _resident_lines(s) -> list[str]:
    top = max(s.slots, key=lambda r: (r.resident, -r.slot))
    div, unit = _scaled(max(top.resident, 1), "B", binary=True)
    mean = sum(r.resident for r in s.slots) / len(s.slots)

    def b(x: float) -> str:
        return f"{x / div:.4g} {unit}"

    copies = f", copies {b(top.copies)}" if s.replicate_size > 1 else ""
    return [
        f"resident per rank: up to {b(top.resident)} (rank {top.slot}), mean {b(mean)}, "
        f"{s.resident_imbalance:.2f}x the mean",
        f"  of it masters {b(top.masters)}, states {b(top.states)}{copies}; "
        f"gathered at once: up to {b(s.gathered_peak)}",
    ]


def render(s) -> list[str]:
    S, R, T = s.world_size, s.replicate_size, s.tensor_size
    mesh = f" ({S // R} shards x {R} replicas)" if R > 1 else ""
    ranks = f"{S} ranks{mesh}"
    if T > 1:  # rows are data slots; each one's matrices run on its T tensor ranks
        ranks = f"{S} data slot{'s' if S > 1 else ''}{mesh} x {T} tensor ranks = {S * T} ranks"
    tdiv, tunit = _scaled(s.total_bytes, "B", binary=True)
    n_matrices = sum(len(r.matrices) for r in s.slots)
    n_pieces = sum(k for _, k in s.sliced)
    n_params = n_matrices + sum(r.others for r in s.slots) - n_pieces + len(s.sliced)
    lines = [
        f"dmuon plan: {ranks}, {n_params} params, "
        f"{s.total_bytes / tdiv:.4g} {tunit} of fp32 masters"
    ]
    batches = [x for x in s.sliced if x[0] not in {t[0] for t in s.teams}]
    if batches:
        name, k = max(batches, key=lambda x: x[1])
        lines.append(
            f"sliced: {len(batches)} batch{'es' if len(batches) > 1 else ''} of matrices into "
            f"{sum(k for _, k in batches)} pieces on distinct shard columns (the most: {k} "
            f"pieces of {name})"
        )
    if s.teams:
        lines += _team_lines(s)
    fdiv, funit = _scaled(max(s.busiest_ns_flops, 1.0), "FLOP")

    def f(x: float) -> str:
        return f"{x / fdiv:.4g} {funit}"

    if s.total_ns_flops:
        lines += [
            f"Newton-Schulz per step: {n_matrices} {'units' if s.sliced else 'matrices'}, "
            f"{f(s.total_ns_flops)} in all, {f(s.mean_ns_flops)} mean per rank",
            f"busiest rank {s.busiest}{' (its busiest tensor rank)' if T > 1 else ''}: "
            f"{f(s.busiest_ns_flops)}, {s.imbalance:.2f}x the mean, "
            f"{s.vs_bound:.3f}x the lower bound max(mean, largest matrix)",
            f"largest matrix: {'x'.join(map(str, s.largest_shape))} {s.largest}, "
            f"{f(s.largest_ns_flops)}",
        ]
        if s.gemm_flops is not None:
            bw = f" and {s.bandwidth:.3g} B/s for team collectives" if s.bandwidth else ""
            lines += [
                f"at {s.gemm_flops:.3g} FLOP/s per GEMM{bw}:",
                f"  the busiest rank's Newton-Schulz takes {_seconds(s.busiest_seconds)} per step"
                f" (mean {_seconds(s.mean_seconds)}, {s.imbalance_seconds:.2f}x; bound "
                f"{_seconds(s.bound_seconds)})",
            ]
    else:
        lines.append("Newton-Schulz per step: none (no matrix in the plan)")
    lines += _resident_lines(s)
    if s.gathered:
        moved = max(r.gather_bytes for r in s.slots)
        div, unit = _scaled(moved, "B", binary=True)
        lines.append(
            f"gathered: {len(s.gathered)} matrices held in {sum(k for _, k in s.gathered)} "
            f"pieces, each orthogonalized by its first piece's rank; up to {moved / div:.4g} "
            f"{unit} per rank and step to and from it"
        )
    bdiv, bunit = _scaled(max(r.nbytes for r in s.slots), "B", binary=True)
    who = "rank (s,r)" if R > 1 else "rank"
    w = max(len(who), len(str(S - 1)))
    lines.append(
        f"{who:>{w}}  matrices  other  {'NS ' + funit:>9}   share  {bunit:>7}  largest matrix"
    )
    # busiest last: a slot both busiest and least is marked busiest
    tags = {s.least: " <- least", s.busiest: " <- busiest"} if s.total_ns_flops else {}
    shown = list(range(S))
    if S > _FULL_TABLE:  # first/last few, busiest, least loaded
        by_load = sorted(range(S), key=lambda i: (-s.slots[i].rank_ns_flops, i))
        keep = {*range(_EDGE), *range(S - _EDGE, S), *by_load[:_BUSIEST], *by_load[-_LEAST:]}
        shown = sorted(keep | {s.busiest, s.least})
    for i, prev in zip(shown, [-1, *shown[:-1]], strict=True):
        if i > prev + 1:
            lines.append(f"{'':>{w}}  ... {i - prev - 1} ranks not shown (all in as_dict())")
        r = s.slots[i]
        label = f"{i} ({r.owner[0]},{r.owner[1]})" if R > 1 else str(i)
        name = r.largest or ""
        name = name if len(name) <= _NAME_WIDTH else "..." + name[3 - _NAME_WIDTH :]
        largest = f"{'x'.join(map(str, r.largest_shape))} {name}" if r.largest else "-"
        lines.append(
            f"{label:>{w}}  {len(r.matrices):8d}  {r.others:5d}  {r.ns_flops / fdiv:9.1f}  "
            f"{100 * r.share:5.1f}%  {r.nbytes / bdiv:7.1f}  {largest}{tags.get(i, '')}"
        )
    return lines
