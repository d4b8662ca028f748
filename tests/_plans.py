"""Test-only readings of a `Plan` (dmuon_fn/planning/_partition.py): the cost of one parameter,
the names a slot owns, the largest slot load, the bytes per shard column, layer collisions."""

from __future__ import annotations

from collections import defaultdict

from dmuon_fn.planning._partition import partition
from dmuon_fn.planning._plan import Plan


def param_cost(shape: tuple[int, ...], *, matrix: bool, blocks=None, **options) -> float:
    """Cost (FLOPs) the planner gives one parameter of `shape` (a matrix's `blocks` spec, if
    given), `partition`'s cost options."""
    specs = None if blocks is None else {"p": blocks}
    ew = () if matrix else ("p",)
    return partition({"p": shape}, 1, elementwise=ew, blocks=specs, **options).costs[0]


def owned_by(plan: Plan, owner: int | tuple[int, int]) -> tuple[str, ...]:
    """Names owned by a slot (int) or by (shard, replicate), in name order."""
    if isinstance(owner, tuple):
        shard, rep = owner
        if not (0 <= shard < plan.shard_size and 0 <= rep < plan.replicate_size):
            raise ValueError(f"owner {owner} outside ({plan.shard_size}, {plan.replicate_size})")
        owner = rep * plan.shard_size + shard
    if not 0 <= owner < plan.world_size:
        raise ValueError(f"slot {owner} outside [0, {plan.world_size})")
    return tuple(n for n, s in zip(plan.names, plan.slots, strict=True) if s == owner)


def max_load(plan: Plan) -> float:
    return max(plan.slot_loads)


def column_bytes(plan: Plan) -> tuple[int, ...]:
    """Bytes of full parameters each shard column holds (per rank, any replica)."""
    out = [0] * plan.shard_size
    for s, b in enumerate(plan.slot_bytes):
        out[s % plan.shard_size] += b
    return tuple(out)


def layer_collisions(plan: Plan) -> tuple[str, ...]:
    """Layers with two matrices in one shard column although they have <= shard_size."""
    per: dict[str, list[int]] = defaultdict(list)
    for layer, m, s in zip(plan.layers, plan.matrix, plan.slots, strict=True):
        if m:
            per[layer].append(s % plan.shard_size)
    return tuple(
        k
        for k, cols in sorted(per.items())
        if len(cols) <= plan.shard_size and len(set(cols)) < len(cols)
    )
