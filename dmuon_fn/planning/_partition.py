"""The partition planner: which rank owns (orthogonalizes and updates) each dedicated parameter.
`partition` is a pure function of (names, shapes, sizes, cost options) to a frozen `Plan` of plain
data, equal on every rank without communicating (FakeTensorMode too); proofs/partition.md.
The plan itself: `planning/_plan.py`; one rank's view of it: `planning/_view.py`."""

from __future__ import annotations

import math
import operator
from collections import defaultdict
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any

from custom_ops._lpt import SPREAD_TOLERANCE, schedule
from custom_ops._lpt import slot_loads as per_slot_sums

from ..ns._blocks import Blocks, block_shapes, check, default_blocks
from ..ns._cost import GRAM_MIN_ASPECT, GRAM_MIN_SHORT, ns_flops, ns_method, team_bytes, team_flops
from ._gathered import gather_pieces
from ._layers import layer_keys
from ._memory import check_cap, choose, element_bytes, rebalance
from ._plan import Plan
from ._slices import check_teams, heaviest, parse_piece, slice_rows, spread_columns
from ._tensor import LOCAL, keeps_matrices

# FLOP-equivalents charged per byte of a parameter (proofs/partition.md §7)
FLOPS_PER_BYTE = 1024.0


def _check(name: str, value: object, ok: Callable[[float], bool], want: str) -> Any:
    """`value` if it is an int or float (not a bool) that `ok` accepts; else a ValueError."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not ok(value):
        raise ValueError(f"{name} must be {want}, got {value!r}")
    return value


def _check_int(name: str, value: object, low: int) -> int:
    return _check(name, value, lambda v: isinstance(v, int) and v >= low, f"an int >= {low}")


def _pairs(named_shapes) -> list[tuple[str, tuple[int, ...]]]:
    items = named_shapes.items() if isinstance(named_shapes, Mapping) else named_shapes
    out: dict[str, tuple[int, ...]] = {}
    for name, shape in items:
        if not isinstance(name, str) or not name:
            raise ValueError(f"parameter names must be non-empty strings, got {name!r}")
        if name in out:
            raise ValueError(f"duplicate parameter name {name!r}: names must be unique")
        try:
            raw = tuple(shape)
            dims = tuple(operator.index(d) for d in raw)
            bad = any(isinstance(d, bool) for d in raw) or any(d < 1 for d in dims)
        except TypeError:
            dims, bad = (), True
        if bad:
            raise ValueError(
                f"{name!r} has shape {shape!r}: a shape is a sequence of positive ints "
                "(leave empty parameters out of the plan)"
            )
        out[name] = dims
    if not out:
        raise ValueError("named_shapes is empty: pass {name: shape} of the dedicated parameters")
    return sorted(out.items())


def partition(
    named_shapes: Mapping[str, Sequence[int]] | Iterable[tuple[str, Sequence[int]]],
    world_size: int,
    *,
    replicate_size: int = 1,
    elementwise: Collection[str] = (),
    steps: int = 5,
    method: str = "auto",
    sym_discount: float = 0.5,
    bytes_per_elem: int = 4,
    flops_per_byte: float = FLOPS_PER_BYTE,
    refine: bool = True,
    spread_tolerance: float = SPREAD_TOLERANCE,
    gram_min_aspect: float = GRAM_MIN_ASPECT,
    gram_min_short: int = GRAM_MIN_SHORT,
    tensor_size: int = 1,
    layouts: Mapping[str, str] | None = None,
    blocks: Mapping[str, Blocks | str] | None = None,
    slices: bool = True,
    teams: Mapping[str, int] | None = None,
    balance_bytes: bool = True,
    max_bytes_per_rank: int | None = None,
    _per_share: int = 2,
    _gather: bool = True,
) -> Plan:
    """One owner slot per parameter of `named_shapes` ({name: shape} or pairs), costs balanced.

    world_size: slots = ranks of the job (shard_size · replicate_size under HSDP).
    elementwise: names of >= 2 dims updated elementwise (AdamW), costed by size.
    steps, method, sym_discount, gram_min_aspect, gram_min_short: as `orthogonalize` runs.
    bytes_per_elem, flops_per_byte: the byte term (fp32 master: 4 bytes).
    refine: False gives plain LPT; True adds refinement, layer spreading and byte balance.
    spread_tolerance: how much longer than the refined unspread schedule the layer-spread one
        may be and still be chosen (0: never above plain LPT's maximum load).
    tensor_size, layouts: T tensor ranks; {name: layout} for every name ("Shard(0)",
        "Replicate()", "plain"; default all "plain"), shapes being whole parameters'; a Shard
        along a batch dim of `blocks` (experts) runs on every tensor rank (tensor slot LOCAL).
    blocks: {name: `Blocks` or its string} for matrices that are more than one 2-D matrix (MoE
        experts, fused qkv, heads; ns/_blocks.py); default: a 3+-D parameter is a batch of
        matrices over its leading dims (pass "flatten" for conv weights), a 2-D one one matrix.
    slices: a batch of matrices costing more than a slot's fair share (the mean load) is cut
        along its leading dim into pieces `name[a:b]` on distinct shard columns (`Plan.sliced`);
        False: every parameter whole (as always under tensor parallelism). A matrix costing
        more than a share gets a team: owners of slices of its long side, sized by the cost
        model, collectives included (proofs/partition.md §10); kept where they lighten a plan.
    teams: {name: k} puts a one-matrix parameter on a team of k (2 <= k <= shard columns),
        whatever it costs, or (k = 1) keeps it whole (with `slices`).
    balance_bytes: move units between slots to even out their resident bytes (masters and
        optimizer states, planning/_memory.py), never above the schedule's busiest NS load;
        then cut matrices still too heavy for their owner into gathered teams (`Plan.gathered`:
        pieces on the lightest ranks, the Newton-Schulz where the schedule put it; §12).
    max_bytes_per_rank: refuse (ValueError, naming the smallest world size that fits) a plan
        whose busiest slot's resident bytes (`resident(plan)`) exceed this.
    """
    options = {k: v for k, v in locals().items() if k in _OPTIONS}
    if max_bytes_per_rank is not None:
        cap = _check_int("max_bytes_per_rank", max_bytes_per_rank, 1)
        plan = partition(named_shapes, world_size, **options, slices=slices, teams=teams)
        return check_cap(plan, cap, lambda w: partition(
            named_shapes, w, **options, slices=slices, teams=teams))  # fmt: skip
    world_size = _check_int("world_size", world_size, 1)
    replicate_size = _check_int("replicate_size", replicate_size, 1)
    if world_size % replicate_size:
        raise ValueError(
            f"replicate_size {replicate_size} does not divide world_size {world_size}: "
            "world_size counts all ranks (shard_size · replicate_size)"
        )
    steps = _check_int("steps", steps, 1)
    bytes_per_elem = _check_int("bytes_per_elem", bytes_per_elem, 1)
    ns_method((1, 1), method)  # validates
    _check("sym_discount", sym_discount, lambda v: 0 < v <= 1, "in (0, 1]")
    for key, val in (("flops_per_byte", flops_per_byte), ("spread_tolerance", spread_tolerance)):
        _check(key, val, lambda v: 0 <= v < math.inf, "finite and >= 0")
    _check("gram_min_aspect", gram_min_aspect, lambda v: v >= 1.0, ">= 1 (inf: never Gram)")
    gram_min_short = _check_int("gram_min_short", gram_min_short, 1)
    tensor_size = _check_int("tensor_size", tensor_size, 1)
    whole = not (slices and tensor_size == 1 and layouts is None)  # every parameter whole
    check_teams(teams or {}, world_size // replicate_size, whole)
    if _gather and balance_bytes and refine and not whole:  # then gathered teams, §12
        plan = partition(
            named_shapes, world_size, **options, slices=slices, teams=teams, _gather=False
        )  # fmt: skip
        keep = [n for n, k in (teams or {}).items() if k == 1]
        return gather_pieces(plan, keep, flops_per_byte, bytes_per_elem)
    names, shapes = zip(*_pairs(named_shapes), strict=True)
    if layouts is not None and set(layouts) != set(names):
        raise ValueError("layouts must name exactly the parameters of named_shapes")
    unknown = sorted(set(elementwise) - set(names))
    if unknown:
        raise ValueError(f"elementwise names not in named_shapes: {unknown[:5]}")
    keys = layer_keys(names)
    ew = set(elementwise)
    matrix = [len(sh) >= 2 and n not in ew for n, sh in zip(names, shapes, strict=True)]
    nbytes = [math.prod(sh) * bytes_per_elem for sh in shapes]
    specs = _specs(names, shapes, matrix, blocks or {})
    ns_kw = {"steps": steps, "method": method, "sym_discount": sym_discount}
    rule = {"min_aspect": gram_min_aspect, "min_short": gram_min_short}

    def ns_of(spec: Blocks | None, shape: tuple[int, ...]) -> float:
        pairs = block_shapes(spec, shape) if spec else ()
        return math.fsum(k * ns_flops(mn, **ns_kw, **rule) for k, mn in pairs)

    def byte_cost(shape: tuple[int, ...]) -> float:
        return flops_per_byte * math.prod(shape) * bytes_per_elem

    sliced: dict[str, tuple[str, ...]] = {}
    parent: dict[str, str] = {}  # a piece -> its parameter
    member_of: dict[str, tuple[tuple[int, ...], int]] = {}  # a team's piece -> (matrix, k)

    def team_cost(sh: tuple[int, ...], share: int, k: int) -> tuple[float, float]:
        """A team member's (NS FLOPs, collective bytes)."""
        flops = team_flops(sh, share, k, **ns_kw, **rule)
        return flops, team_bytes(sh, k, steps=steps, method=method, **rule)

    def member(sh: tuple[int, ...], share: int, k: int) -> float:  # its cost
        flops, comm = team_cost(sh, share, k)
        return flops + byte_cost(sh) * share / max(sh) + flops_per_byte * comm

    if not whole and world_size // replicate_size > 1:
        costs = [ns_of(b, sh) + byte_cost(sh) for b, sh in zip(specs, shapes, strict=True)]
        rows, sliced, member_of = slice_rows(
            (names, shapes, matrix, specs, costs), world_size, world_size // replicate_size,
            teams or {}, _per_share, member, balance_bytes,
        )  # fmt: skip
        rows.sort(key=lambda r: r[0])
        parent = {p: n for n, ps in sliced.items() for p in ps}
        keys = {p: keys[parent.get(p, p)] for p, *_ in rows}
        names, shapes, matrix, specs = (tuple(col) for col in zip(*rows, strict=True))
        nbytes = [math.prod(sh) * bytes_per_elem for sh in shapes]
    ns, comm = [], []  # comm: a team member's collective bytes, charged as bytes
    for n, b, sh in zip(names, specs, shapes, strict=True):
        full, k = member_of.get(n, ((), 1))  # a team member: its matrix's shape, its team size
        f, c = team_cost(full, math.prod(sh) // min(full), k) if full else (ns_of(b, sh), 0.0)
        ns.append(f)
        comm.append(c)
    costs = [
        f + byte_cost(sh) + flops_per_byte * c for f, sh, c in zip(ns, shapes, comm, strict=True)
    ]

    # Units in order of their first name: each matrix alone, a layer's other params together.
    by_unit: dict[int | str, list[int]] = defaultdict(list)
    for i, n in enumerate(names):
        by_unit[i if matrix[i] else keys[n]].append(i)
    units = list(by_unit.values())
    layer_id = {k: j for j, k in enumerate(sorted(set(keys.values())))}
    unit_costs = [math.fsum(costs[i] for i in u) for u in units]
    u_slot = schedule(
        unit_costs, world_size,
        groups=[layer_id[keys[names[u[0]]]] if matrix[u[0]] else -1 for u in units],
        nbytes=[sum(nbytes[i] for i in u) for u in units],
        replicate=replicate_size, refined=refine, spread_tolerance=spread_tolerance,
    )  # fmt: skip
    if balance_bytes and refine:  # even out resident bytes within the NS bound
        u_slot = rebalance(
            u_slot,
            [math.fsum(ns[i] + flops_per_byte * comm[i] for i in u) for u in units],
            unit_costs,
            [sum(element_bytes(matrix[i]) * math.prod(shapes[i]) for i in u) for u in units],
            world_size,
            [parent.get(names[u[0]]) for u in units],
            world_size // replicate_size,
        )
    slots = [0] * len(names)
    for u, s in zip(units, u_slot, strict=True):
        for i in u:
            slots[i] = s
    index = {n: i for i, n in enumerate(names)}
    pieces = [[index[p] for p in ps] for ps in sliced.values()]
    is_team = [ps[0] in member_of for ps in sliced.values()]
    spread_columns(pieces, slots, costs, world_size, world_size // replicate_size, is_team)
    loads: list[list[float]] = [[] for _ in range(world_size)]
    for i, s in enumerate(slots):
        loads[s].append(costs[i])  # fsum'd: exact in any order

    tensor_slots, layout = [], ()
    if tensor_size > 1 or layouts is not None:
        layout = tuple((layouts or {}).get(n, "plain") for n in names)
        local = [keeps_matrices(lay, b) for lay, b in zip(layout, specs, strict=True)]
        tensor_slots = _tensor_slots(slots, ns, tensor_size, local)

    plan = Plan(
        names=names,
        shapes=shapes,
        slots=tuple(slots),
        layers=tuple(keys[n] for n in names),
        matrix=tuple(matrix),
        costs=tuple(costs),
        nbytes=tuple(nbytes),
        world_size=world_size,
        replicate_size=replicate_size,
        slot_loads=tuple(math.fsum(x) for x in loads),
        slot_bytes=tuple(per_slot_sums(nbytes, slots, world_size)),
        ns_flops=tuple(ns),
        tensor_size=tensor_size,
        tensor_slots=tuple(tensor_slots),
        layouts=layout,
        blocks=tuple(specs),
        sliced=tuple(sorted(sliced.items())),
        teams=tuple(sorted({parse_piece(p).param for p in member_of})),
        team_bytes=tuple(comm),
    )
    if not sliced:
        return plan
    # slices and teams are kept only where they lighten the busiest slot, batches cut into pieces
    # of about 1/2 or 1/4 of a share, whichever is lighter (proofs/partition.md §9)
    if teams or _per_share != 2:  # asked for, or one of the candidates below
        return plan
    unsliced = partition(named_shapes, world_size, **options, slices=False)
    finer = partition(named_shapes, world_size, **options, _per_share=4, _gather=False)
    return choose((plan, finer, unsliced), balance_bytes, heaviest)


_OPTIONS = (  # partition's keywords but `slices` and `teams`
    *("replicate_size", "elementwise", "steps", "method", "sym_discount", "bytes_per_elem"),
    *("flops_per_byte", "refine", "spread_tolerance", "gram_min_aspect", "gram_min_short"),
    *("tensor_size", "layouts", "blocks", "balance_bytes"),
)


def _specs(names, shapes, matrix, given: Mapping[str, Blocks | str]) -> list[Blocks | None]:
    """Each parameter's checked `Blocks` (None: elementwise), `given` or the default."""
    unknown = sorted(set(given) - {n for n, m in zip(names, matrix, strict=True) if m})
    if unknown:
        raise ValueError(
            f"blocks names {unknown[:5]}, not matrices of the plan: give specs only for the "
            "parameters Muon updates (dedicated matrices, by their names)"
        )
    return [
        (check(given[n], sh, n) if n in given else default_blocks(sh, conv=False)) if m else None
        for n, sh, m in zip(names, shapes, matrix, strict=True)
    ]


def _tensor_slots(
    slots: list[int], ns: list[float], tensor_size: int, local: list[bool]
) -> list[int]:
    """Per parameter, its owner slot's tensor rank that runs its NS, or LOCAL: every tensor rank
    its own part's (proofs/partition.md §8)."""
    out = [LOCAL if x else 0 for x in local]
    per_slot: dict[int, list[int]] = defaultdict(list)
    for i, s in enumerate(slots):
        if ns[i] > 0 and not local[i]:
            per_slot[s].append(i)
    for idx in per_slot.values():
        for i, t in zip(idx, schedule([ns[i] for i in idx], tensor_size), strict=True):
            out[i] = t
    return out
