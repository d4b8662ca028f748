"""The partition planner: which rank owns (orthogonalizes and updates) each dedicated parameter.

`partition` is a pure function of (names, shapes, world size, replicate size, cost options) to a
frozen `Plan` of plain Python data, so every rank computes the same plan without communicating
(`check_plan_consistent` verifies that once) and it runs anywhere, FakeTensorMode included.

Cost model (one number per parameter, in FLOPs; proofs/partition.md, BENCHMARKS.md):

    matrix (>= 2 dims, trailing dims flattened to (shape[0], prod(shape[1:]))):
        ns_flops(rows × cols, steps, method, sym_discount)  +  flops_per_byte · bytes
    anything else (AdamW on the owner, elementwise):          flops_per_byte · bytes

`ns_flops` counts the iteration `orthogonalize` will run (Gram or standard by the same `auto`
rule) with symmetric products at `sym_discount` of a GEMM (0.5 with a SYRK kernel, 1.0 without).
The byte term charges the elementwise work (momentum, update, weight decay) and the
gradient/parameter traffic through the owner, both proportional to the parameter's bytes.
Against measured `orthogonalize` time on a CPU the model gives Pearson r = 0.987 between log time
and log cost over 16 shapes (examples/benchmarks/bench_cost_model.py); what it leaves out is a
fixed cost per call (~2 ms there), which matters only for matrices below ~256².

Scheduling units: each matrix is a unit; a layer's non-matrix params (norms, biases) are packed
into one unit, so they travel with one owner. Layers are found by name (`layer_keys`).
"""

from __future__ import annotations

import hashlib
import json
import math
import operator
from collections import defaultdict
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

from custom_ops._lpt import SPREAD_TOLERANCE, schedule

from ..ns._cost import GRAM_MIN_ASPECT, ns_flops

# Default FLOP-equivalents charged per byte of a parameter. The two-term fit
# time ≈ α·FLOPs + β·bytes of `orthogonalize` on this CPU gives β/α ≈ 1300
# (examples/benchmarks/bench_cost_model.py); on an H100 the elementwise fp32 update moves ~5
# bytes per parameter byte at a machine balance of ~300 FLOP/byte, about the same. Rounded down.
FLOPS_PER_BYTE = 1024.0

_ShapeLike = Sequence[int]


def _numeric(part: str) -> bool:
    return part.isascii() and part.isdigit()


def layer_keys(names: Iterable[str]) -> dict[str, str]:
    """Layer of each parameter name: the module prefix up to its outermost repeated index.

    PyTorch names repeated blocks by a decimal index (ModuleList/Sequential), whatever the
    attribute is called: `model.layers.3`, `blocks.3`, `transformer.h.3`. The key is the name up
    to the outermost numeric component whose siblings take at least two values (so a wrapper
    `model.0.layers.3` keys on `layers.3`), else up to the outermost numeric component, else the
    parent module (`lm_head.weight` -> `lm_head`). Experts inside a block share the block's key.
    """
    names = list(names)
    split = {n: n.split(".") for n in names}
    seen: dict[tuple[str, ...], set[str]] = defaultdict(set)
    for parts in split.values():
        for i, p in enumerate(parts[:-1]):
            if _numeric(p):
                seen[tuple(parts[:i])].add(p)
    keys = {}
    for n, parts in split.items():
        idx = [i for i, p in enumerate(parts[:-1]) if _numeric(p)]
        rep = [i for i in idx if len(seen[tuple(parts[:i])]) > 1]
        cut = rep[0] + 1 if rep else idx[0] + 1 if idx else len(parts) - 1
        keys[n] = ".".join(parts[:cut])
    return keys


def param_cost(
    shape: _ShapeLike,
    *,
    matrix: bool,
    steps: int = 5,
    method: str = "auto",
    sym_discount: float = 0.5,
    bytes_per_elem: int = 4,
    flops_per_byte: float = FLOPS_PER_BYTE,
    gram_min_aspect: float = GRAM_MIN_ASPECT,
) -> float:
    """Cost (FLOPs) of owning one parameter of `shape`: the model in the module docstring."""
    byte_term = _byte_term(shape, flops_per_byte, bytes_per_elem)
    if not matrix:
        return byte_term
    return _ns(shape, steps, method, sym_discount, gram_min_aspect) + byte_term


def _byte_term(shape, flops_per_byte, bytes_per_elem) -> float:
    """The cost charged per byte of a parameter of `shape` (elementwise work and traffic)."""
    return flops_per_byte * math.prod(shape) * bytes_per_elem


def _ns(shape, steps, method, sym_discount, gram_min_aspect) -> float:
    """Newton-Schulz FLOPs of a matrix of `shape` (trailing dims flattened)."""
    rows = shape[0]
    flat = (rows, math.prod(shape) // rows)
    return ns_flops(
        flat, steps=steps, method=method, sym_discount=sym_discount, min_aspect=gram_min_aspect
    )


@dataclass(frozen=True)
class Plan:
    """Owner of every dedicated parameter; plain Python data, identical on every rank.

    Slots: world_size = shard_size · replicate_size of them. Slot s is shard s % shard_size of
    replica s // shard_size, i.e. global rank s of a (replicate, shard) mesh; on a 1-D mesh
    (replicate_size 1) the slot is the rank. The owner of a parameter holds its full fp32 value
    and optimizer state and runs its update; every rank of the owner's shard column (same shard
    index, any replica) holds the full parameter after the update is published.

    Per parameter, in name order: names, shapes, slots (owner slot), layers (layer key), matrix
    (Muon vs elementwise), costs (FLOPs), nbytes, ns_flops (the Newton-Schulz part of the
    cost, 0 for elementwise params). Per slot: slot_loads (sum of costs), slot_bytes (sum of
    bytes).
    """

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    slots: tuple[int, ...]
    layers: tuple[str, ...]
    matrix: tuple[bool, ...]
    costs: tuple[float, ...]
    nbytes: tuple[int, ...]
    world_size: int
    replicate_size: int
    slot_loads: tuple[float, ...]
    slot_bytes: tuple[int, ...]
    ns_flops: tuple[float, ...]
    # tensor parallelism (`tensor_size` > 1, or `layouts` given): each parameter's layout over
    # the tensor-parallel ranks, and the tensor rank of its owner slot that runs its
    # Newton-Schulz (the owner slot's T tensor ranks each hold and update a part of it)
    tensor_size: int = 1
    tensor_slots: tuple[int, ...] = ()
    layouts: tuple[str, ...] = ()

    @property
    def shard_size(self) -> int:
        return self.world_size // self.replicate_size

    def _index(self, name: str) -> int:
        i, hi = 0, len(self.names)  # bisect_left, in Python so that dynamo traces it
        while i < hi:
            mid = (i + hi) // 2
            i, hi = (mid + 1, hi) if self.names[mid] < name else (i, mid)
        if i == len(self.names) or self.names[i] != name:
            raise KeyError(f"{name!r} is not in the plan ({len(self.names)} parameters)")
        return i

    def slot(self, name: str) -> int:
        """Owner slot of `name` in [0, world_size)."""
        return self.slots[self._index(name)]

    def coords(self, slot: int) -> tuple[int, int]:
        """(shard, replica) of `slot`: slot = replica · shard_size + shard."""
        return slot % self.shard_size, slot // self.shard_size

    def label(self, slot: int) -> int | tuple[int, int]:
        """`slot` as users name owners: the rank (1-D mesh), or (shard, replica) under HSDP."""
        return slot if self.replicate_size == 1 else self.coords(slot)

    def owner(self, name: str) -> int | tuple[int, int]:
        """Owner rank of `name` (1-D mesh), or its (shard, replicate) coordinates under HSDP."""
        return self.label(self.slot(name))

    def tensor_slot(self, name: str) -> int:
        """The tensor-parallel rank of `name`'s owner slot that orthogonalizes it (0 without
        tensor parallelism)."""
        return self.tensor_slots[self._index(name)] if self.tensor_slots else 0

    def owned_by(self, owner: int | tuple[int, int]) -> tuple[str, ...]:
        """Names owned by a slot (int) or by (shard, replicate), in name order."""
        if isinstance(owner, tuple):
            shard, rep = owner
            if not (0 <= shard < self.shard_size and 0 <= rep < self.replicate_size):
                raise ValueError(
                    f"owner {owner} outside ({self.shard_size}, {self.replicate_size})"
                )
            owner = rep * self.shard_size + shard
        if not 0 <= owner < self.world_size:
            raise ValueError(f"slot {owner} outside [0, {self.world_size})")
        return tuple(n for n, s in zip(self.names, self.slots, strict=True) if s == owner)

    @property
    def column_bytes(self) -> tuple[int, ...]:
        """Bytes of full parameters each shard column holds (per rank, any replica)."""
        out = [0] * self.shard_size
        for s, b in enumerate(self.slot_bytes):
            out[s % self.shard_size] += b
        return tuple(out)

    @property
    def max_load(self) -> float:
        return max(self.slot_loads)

    def layer_collisions(self) -> tuple[str, ...]:
        """Layers with two matrices in one shard column although they have <= shard_size."""
        per: dict[str, list[int]] = defaultdict(list)
        for layer, m, s in zip(self.layers, self.matrix, self.slots, strict=True):
            if m:
                per[layer].append(s % self.shard_size)
        return tuple(
            k
            for k, cols in sorted(per.items())
            if len(cols) <= self.shard_size and len(set(cols)) < len(cols)
        )

    def canonical(self) -> str:
        """The encoding `digest` hashes: JSON of sizes and (name, shape, slot) in name order;
        with tensor parallelism also the tensor size and (layout, tensor slot) per name."""
        body = {
            "world_size": self.world_size,
            "replicate_size": self.replicate_size,
            "params": [
                [n, list(sh), s]
                for n, sh, s in zip(self.names, self.shapes, self.slots, strict=True)
            ],
        }
        if self.tensor_slots or self.layouts:
            body["tensor_size"] = self.tensor_size
            body["tensor"] = [list(x) for x in zip(self.layouts, self.tensor_slots, strict=True)]
        return json.dumps(body, separators=(",", ":"), ensure_ascii=True)

    def digest(self) -> str:
        """sha256 hex of `canonical()`: equal on every rank exactly when the plans are equal."""
        return hashlib.sha256(self.canonical().encode("ascii")).hexdigest()


def _check_int(name: str, value: object, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    return value


def _pairs(named_shapes) -> list[tuple[str, tuple[int, ...]]]:
    items = named_shapes.items() if isinstance(named_shapes, Mapping) else named_shapes
    out, seen = [], set()
    for name, shape in items:
        if not isinstance(name, str) or not name:
            raise ValueError(f"parameter names must be non-empty strings, got {name!r}")
        if name in seen:
            raise ValueError(f"duplicate parameter name {name!r}: names must be unique")
        seen.add(name)
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
        out.append((name, dims))
    if not out:
        raise ValueError("named_shapes is empty: pass {name: shape} of the dedicated parameters")
    return sorted(out)


def partition(
    named_shapes: Mapping[str, _ShapeLike] | Iterable[tuple[str, _ShapeLike]],
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
    tensor_size: int = 1,
    layouts: Mapping[str, str] | None = None,
) -> Plan:
    """Assign every parameter exactly one owner slot, balancing the cost model above.

    named_shapes: {name: shape} (or (name, shape) pairs) of the dedicated parameters.
    world_size: number of owner slots = ranks of the job (shard_size · replicate_size under HSDP).
    replicate_size: HSDP replicas R; each matrix is still orthogonalized once in the whole job.
    elementwise: names updated elementwise (AdamW) though they have >= 2 dims (embeddings,
        heads), costed by size.
    steps, method, sym_discount, gram_min_aspect: as `orthogonalize` will run (see
        `dmuon_fn.ns._cost.ns_flops`; dedicate_params and plan pass the ratio the job's dispatch
        measured, dmuon_fn/ns/_dispatch.py).
    bytes_per_elem, flops_per_byte: the byte term (fp32 master: 4 bytes).
    refine: False gives plain LPT (the baseline); True adds refinement, layer spreading and
        byte balance (custom_ops/_lpt.py, steps 2-4).
    spread_tolerance: how much longer than the refined unspread schedule the layer-spread one
        may be and still be chosen (0: the plan never exceeds plain LPT's maximum load; always
        within the LPT bound).

    tensor_size, layouts: tensor parallelism (T ranks; {name: layout}, e.g. "Shard(0)",
        "Replicate()", "plain", for every name; default all "plain"). Shapes are the whole
        parameters'. An owner slot is then a data-parallel coordinate whose T tensor ranks each
        hold their part of the parameter; within each slot the matrices' Newton-Schulz runs
        are spread over the T tensor ranks by the same scheduler (`Plan.tensor_slots`), so the
        busiest (data, tensor) rank is balanced in two levels: data slots first, tensor ranks
        within each.

    The result depends only on the names and shapes, not on their order or on hash seeds.
    """
    world_size = _check_int("world_size", world_size, 1)
    replicate_size = _check_int("replicate_size", replicate_size, 1)
    if world_size % replicate_size:
        raise ValueError(
            f"replicate_size {replicate_size} does not divide world_size {world_size}: "
            "world_size counts all ranks (shard_size · replicate_size)"
        )
    steps = _check_int("steps", steps, 1)
    bytes_per_elem = _check_int("bytes_per_elem", bytes_per_elem, 1)
    if method not in ("auto", "gram", "standard"):
        raise ValueError(f"method must be 'auto', 'gram' or 'standard', got {method!r}")
    if not 0 < sym_discount <= 1:
        raise ValueError(f"sym_discount must be in (0, 1], got {sym_discount!r}")
    for key, val in (("flops_per_byte", flops_per_byte), ("spread_tolerance", spread_tolerance)):
        if not 0 <= val < math.inf:
            raise ValueError(f"{key} must be finite and >= 0, got {val!r}")
    if not gram_min_aspect >= 1.0:
        raise ValueError(f"gram_min_aspect must be >= 1 (inf: never Gram), got {gram_min_aspect!r}")
    tensor_size = _check_int("tensor_size", tensor_size, 1)
    pairs = _pairs(named_shapes)
    names = [n for n, _ in pairs]
    if layouts is not None and set(layouts) != set(names):
        raise ValueError("layouts must name exactly the parameters of named_shapes")
    unknown = sorted(set(elementwise) - set(names))
    if unknown:
        raise ValueError(f"elementwise names not in named_shapes: {unknown[:5]}")
    keys = layer_keys(names)
    ew = set(elementwise)
    matrix = [len(sh) >= 2 and n not in ew for n, sh in pairs]
    nbytes = [math.prod(sh) * bytes_per_elem for _, sh in pairs]
    # the Newton-Schulz part of each cost, kept in the plan (0 for elementwise params)
    ns_kw = (steps, method, sym_discount, gram_min_aspect)
    ns = [_ns(sh, *ns_kw) if m else 0.0 for (_, sh), m in zip(pairs, matrix, strict=True)]
    # as param_cost, each NS count computed once (0.0 + the byte term is the byte term exactly)
    costs = [
        f + _byte_term(sh, flops_per_byte, bytes_per_elem)
        for f, (_, sh) in zip(ns, pairs, strict=True)
    ]

    # Units in order of their first name: each matrix alone, a layer's other params together.
    unit_of, units, packs = [], [], {}
    for i, (n, _) in enumerate(pairs):
        if matrix[i]:
            unit_of.append(len(units))
            units.append([i])
        else:
            if keys[n] not in packs:
                packs[keys[n]] = len(units)
                units.append([])
            unit_of.append(packs[keys[n]])
            units[unit_of[-1]].append(i)
    layer_id = {k: j for j, k in enumerate(sorted(set(keys.values())))}
    u_groups = [layer_id[keys[names[u[0]]]] if matrix[u[0]] else -1 for u in units]
    u_costs = [math.fsum(costs[i] for i in u) for u in units]
    u_bytes = [sum(nbytes[i] for i in u) for u in units]
    u_slot = schedule(
        u_costs,
        world_size,
        groups=u_groups,
        nbytes=u_bytes,
        replicate=replicate_size,
        refined=refine,
        spread_tolerance=spread_tolerance,
    )
    slots = [u_slot[unit_of[i]] for i in range(len(pairs))]

    tensor_slots: list[int] = []
    if tensor_size > 1 or layouts is not None:
        tensor_slots = _tensor_slots(slots, ns, tensor_size)
        if layouts is None:  # every parameter plain: a whole copy on each tensor rank
            layouts = dict.fromkeys(names, "plain")

    loads: list[list[float]] = [[] for _ in range(world_size)]
    sbytes = [0] * world_size
    for i, s in enumerate(slots):
        loads[s].append(costs[i])
        sbytes[s] += nbytes[i]
    return Plan(
        names=tuple(names),
        shapes=tuple(sh for _, sh in pairs),
        slots=tuple(slots),
        layers=tuple(keys[n] for n in names),
        matrix=tuple(matrix),
        costs=tuple(costs),
        nbytes=tuple(nbytes),
        world_size=world_size,
        replicate_size=replicate_size,
        slot_loads=tuple(math.fsum(x) for x in loads),
        slot_bytes=tuple(sbytes),
        ns_flops=tuple(ns),
        tensor_size=tensor_size,
        tensor_slots=tuple(tensor_slots),
        layouts=tuple(layouts[n] for n in names) if layouts is not None else (),
    )


def _tensor_slots(slots: list[int], ns: list[float], tensor_size: int) -> list[int]:
    """Per parameter, the tensor rank of its owner slot that runs its Newton-Schulz: each
    slot's matrices scheduled over its `tensor_size` ranks by their Newton-Schulz FLOPs
    (elementwise parameters, with none, stay on rank 0)."""
    out = [0] * len(slots)
    per_slot: dict[int, list[int]] = defaultdict(list)
    for i, s in enumerate(slots):
        if ns[i] > 0:
            per_slot[s].append(i)
    for idx in per_slot.values():
        for i, t in zip(idx, schedule([ns[i] for i in idx], tensor_size), strict=True):
            out[i] = t
    return out
