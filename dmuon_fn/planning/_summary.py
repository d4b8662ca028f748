"""`plan_summary(plan)`: a frozen `PlanSummary` of per-slot rows and job totals (`Plan.ns_flops`;
seconds with a GEMM rate); `str()` a table, `as_dict()` JSON-ready data (proofs/summary.md)."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass

import torch

from ..comm._mesh import check_dtype
from ..ns._calibrate import race
from ..ns._cost import ns_flops
from ..ns._dispatch import iteration_dtype
from ..ns._orthogonalize import _default_device
from ._memory import MASTER_BYTES, resident
from ._partition import _check, _check_int
from ._plan import Plan
from ._render import render
from ._slices import covered, parse_piece, piece_name
from ._tensor import tensor_shares


@dataclass(frozen=True)
class SlotSummary:
    """One owner slot (global rank `slot` of a (replicate, shard) mesh)."""

    slot: int
    owner: int | tuple[int, int]  # `Plan.label(slot)`
    matrices: tuple[str, ...]  # those it orthogonalizes, in name order
    others: int  # how many parameters it updates elementwise
    ns_flops: float  # Newton-Schulz FLOPs per step of its matrices
    share: float  # of the job's NS FLOPs (0 if none)
    nbytes: int  # fp32 master bytes of everything it owns
    largest: str | None  # its matrix with the most NS FLOPs (first in name order), None if none
    largest_shape: tuple[int, ...] | None
    largest_ns_flops: float
    tensor_ns_flops: tuple[float, ...] = ()  # per tensor rank of the slot; () without TP
    team_bytes: float = 0.0  # what its team members send and receive per step (CommCounter's)
    # resident bytes between steps (planning/_memory.py): fp32 masters, optimizer states (Muon
    # momentum, AdamW's two moments), HSDP copies of other replicas' parameters (fp32)
    masters: int = 0
    states: int = 0
    copies: int = 0
    # what its gathered groups' two all-to-alls send and receive per step (fp32; §12)
    gather_bytes: float = 0.0

    @property
    def resident(self) -> int:
        return self.masters + self.states + self.copies

    @property
    def rank_ns_flops(self) -> float:
        """NS FLOPs of the slot's busiest tensor rank (without TP: the slot's)."""
        return max(self.tensor_ns_flops) if self.tensor_ns_flops else self.ns_flops


@dataclass(frozen=True)
class PlanSummary:
    """A plan's per-slot rows (`slots`, index = slot) and the job's Newton-Schulz totals."""

    world_size: int
    replicate_size: int
    slots: tuple[SlotSummary, ...]
    total_ns_flops: float
    total_bytes: int
    busiest: int  # the slot with the most NS FLOPs (lowest on ties)
    least: int  # the slot with the least
    largest: str | None  # the job's matrix with the most NS FLOPs
    largest_shape: tuple[int, ...] | None
    largest_ns_flops: float
    gemm_flops: float | None = None  # FLOP/s of one device's GEMM
    tensor_size: int = 1  # tensor-parallel ranks per slot: the job has world_size · this ranks
    # (parameter, its pieces) per parameter the slicer cut (a gathered group: one piece, §12)
    sliced: tuple[tuple[str, int], ...] = ()
    # (matrix, members, their NS FLOPs, one owner's) per team (proofs/team_ns.md); bytes/s of
    # a team's collectives, for seconds
    teams: tuple[tuple[str, int, float, float], ...] = ()
    bandwidth: float | None = None
    # the most bytes of gathered full values a rank holds at once: Z3 with prefetch 1 holds two
    # layers' dedicated parameters (fp32; half of it gathered in bf16), the largest two
    gathered_peak: int = 0
    # (what it orthogonalizes, its pieces) per gathered group (proofs/partition.md §12)
    gathered: tuple[tuple[str, int], ...] = ()

    @property
    def resident_imbalance(self) -> float:
        """busiest / mean resident bytes (1.0 when nothing is held)."""
        held = [r.resident for r in self.slots]
        mean = sum(held) / len(held)
        return max(held) / mean if mean else 1.0

    @property
    def busiest_ns_flops(self) -> float:
        return self.slots[self.busiest].rank_ns_flops

    @property
    def mean_ns_flops(self) -> float:
        return self.total_ns_flops / (self.world_size * self.tensor_size)

    @property
    def bound_ns_flops(self) -> float:
        """max(largest matrix, mean): no partition's busiest rank has less."""
        return max(self.largest_ns_flops, self.mean_ns_flops)

    @property
    def imbalance(self) -> float:
        """busiest / mean, >= 1; 1.0 when there is no Newton-Schulz work."""
        return self.busiest_ns_flops / self.mean_ns_flops if self.total_ns_flops else 1.0

    @property
    def vs_bound(self) -> float:
        """busiest / bound, >= 1: 1.0 means no partition could make the busiest slot lighter."""
        return self.busiest_ns_flops / self.bound_ns_flops if self.total_ns_flops else 1.0

    @property
    def busiest_seconds(self) -> float | None:
        """The busiest rank's NS seconds per step at `gemm_flops` (None without), its team
        collectives' at `bandwidth` added: the most over slots."""
        if self.gemm_flops is None:
            return None
        return max(self.seconds(r) for r in self.slots)

    def seconds(self, r: SlotSummary) -> float:
        """A slot's NS seconds per step (`gemm_flops` needed), with its teams' collectives."""
        comm = r.team_bytes / self.bandwidth if self.bandwidth else 0.0
        return r.rank_ns_flops / self.gemm_flops + comm

    @property
    def mean_seconds(self) -> float | None:
        if self.gemm_flops is None:
            return None
        return math.fsum(self.seconds(r) for r in self.slots) / len(self.slots)

    @property
    def imbalance_seconds(self) -> float | None:
        """busiest / mean in seconds (`gemm_flops` needed; team collectives at `bandwidth`
        counted): what the busiest rank adds to a step over an even share."""
        busiest, mean = self.busiest_seconds, self.mean_seconds
        if busiest is None:
            return None
        return busiest / mean if mean else 1.0

    @property
    def bound_seconds(self) -> float | None:
        return None if self.gemm_flops is None else self.bound_ns_flops / self.gemm_flops

    def as_dict(self) -> dict:
        """Plain data (lists, str, int, float, None) for `json.dumps`."""
        d = {
            "world_size": self.world_size,
            "replicate_size": self.replicate_size,
            "tensor_size": self.tensor_size,
            "matrices": sum(len(r.matrices) for r in self.slots),
            "others": sum(r.others for r in self.slots),
            "total_ns_flops": self.total_ns_flops,
            "total_bytes": self.total_bytes,
            "mean_ns_flops": self.mean_ns_flops,
            "busiest_slot": self.busiest,
            "busiest_ns_flops": self.busiest_ns_flops,
            "least_slot": self.least,
            "least_ns_flops": self.slots[self.least].rank_ns_flops,
            "largest_matrix": self.largest,
            "largest_shape": self.largest_shape,
            "largest_ns_flops": self.largest_ns_flops,
            "bound_ns_flops": self.bound_ns_flops,
            "imbalance": self.imbalance,
            "vs_bound": self.vs_bound,
            "gemm_flops": self.gemm_flops,
            "busiest_seconds": self.busiest_seconds,
            "mean_seconds": self.mean_seconds,
            "imbalance_seconds": self.imbalance_seconds,
            "bandwidth": self.bandwidth,
            "teams": self.teams,
            "bound_seconds": self.bound_seconds,
            "gathered_peak": self.gathered_peak,
            "resident_imbalance": self.resident_imbalance,
            "slots": [dataclasses.asdict(r) for r in self.slots],
            "sliced": self.sliced,
            "gathered": self.gathered,
        }
        return json.loads(json.dumps(d))  # every tuple a list

    def __str__(self) -> str:
        return "\n".join(render(self))


def _largest(plan: Plan, idx: list[int], one: list[float], shown: dict | None = None) -> dict:
    """largest, largest_shape, largest_ns_flops of the matrices `idx` (None, None, 0.0 if none)
    by `one`: the NS FLOPs one rank runs of each (all of it, or an expert rank's share);
    `shown`: a gathered group's (name, shape) by its first piece's index (`_gathered`)."""
    top = max(idx, key=lambda i: (one[i], -i), default=None)
    if top is None:
        return {"largest": None, "largest_shape": None, "largest_ns_flops": 0.0}
    name, shape = (shown or {}).get(top) or (plan.names[top], plan.shapes[top])
    return {
        "largest": name,
        "largest_shape": shape,
        "largest_ns_flops": one[top],
    }


def plan_summary(
    plan: object, *, gemm_flops: float | None = None, bandwidth: float | None = None
) -> PlanSummary:
    """Per-slot rows and job totals of a `Plan` or an `FnPlan`; gemm_flops (FLOP/s of one
    device's GEMM in the NS iteration dtype, `measure_gemm_flops()`) adds seconds per step,
    bandwidth (bytes/s a team member's collectives move) the teams' collectives to them."""
    part = getattr(plan, "partition", None)  # an FnPlan's Plan
    plan = part if isinstance(part, Plan) else plan
    if not isinstance(plan, Plan):
        raise ValueError(
            "plan_summary takes a Plan (from partition), an FnPlan (from plan) or a model "
            f"prepared by dedicate_params, got {type(plan).__name__}"
        )
    if gemm_flops is not None:
        positive = "finite and > 0 (FLOP/s, e.g. 4e14)"
        gemm_flops = float(_check("gemm_flops", gemm_flops, lambda v: 0 < v < math.inf, positive))
    if bandwidth is not None:
        want = "finite and > 0 (bytes/s, e.g. 4e11)"
        bandwidth = float(_check("bandwidth", bandwidth, lambda v: 0 < v < math.inf, want))
    comm = plan.team_bytes or (0.0,) * len(plan.names)
    flops, total = plan.ns_flops, math.fsum(plan.ns_flops)
    T = plan.tensor_size if plan.tensor_slots else 0
    shares = [  # per parameter, of its NS per tensor rank; () without TP
        tensor_shares(plan.shapes[i], plan.layouts[i], plan.tensor_slots[i], T) if T else ()
        for i in range(len(flops))
    ]
    one = [f * max(sh, default=1.0) for f, sh in zip(flops, shares, strict=True)]
    members: list[list[int]] = [[] for _ in range(plan.world_size)]
    for i, s in enumerate(plan.slots):
        members[s].append(i)
    held = resident(plan)
    shown, moved = _gathered(plan)
    rows = []
    for s, mine in enumerate(members):
        mats = [i for i in mine if plan.matrix[i] and shown.get(i, ()) is not None]
        ns = math.fsum(flops[i] for i in mats)
        per_tensor = tuple(math.fsum(flops[i] * shares[i][t] for i in mats) for t in range(T))
        rows.append(
            SlotSummary(
                slot=s,
                owner=plan.label(s),
                matrices=tuple((shown.get(i) or (plan.names[i],))[0] for i in mats),
                others=sum(not plan.matrix[i] for i in mine),
                ns_flops=ns,
                share=ns / total if total else 0.0,
                nbytes=sum(plan.nbytes[i] for i in mine),
                **_largest(plan, mats, one, shown),
                tensor_ns_flops=per_tensor,
                team_bytes=math.fsum(comm[i] for i in mine),
                masters=held.masters[s],
                states=held.states[s],
                copies=held.copies[s],
                gather_bytes=math.fsum(moved.get(i, 0.0) for i in mine),
            )
        )
    per_layer: dict[str, int] = {}
    for layer, nb in zip(plan.layers, plan.nbytes, strict=True):
        per_layer[layer] = per_layer.get(layer, 0) + nb
    loads = [r.rank_ns_flops for r in rows]
    teams = [(n, plan.team(n), covered(plan, plan.pieces(n))[0]) for n in plan.teams]
    return PlanSummary(
        world_size=plan.world_size,
        replicate_size=plan.replicate_size,
        slots=tuple(rows),
        total_ns_flops=total,
        total_bytes=sum(plan.nbytes),
        busiest=loads.index(max(loads)),
        least=loads.index(min(loads)),
        **_largest(plan, [i for i, m in enumerate(plan.matrix) if m], one, shown),
        gemm_flops=gemm_flops,
        tensor_size=plan.tensor_size if plan.tensor_slots else 1,
        sliced=_sliced(plan),
        gathered_peak=sum(sorted(per_layer.values())[-2:]),
        teams=tuple(
            (n, len(ps), math.fsum(flops[plan._index(p)] for p in ps), ns_flops(whole))
            for n, ps, whole in teams
        ),
        bandwidth=bandwidth,
        gathered=tuple((shown[plan._index(g[0])][0], len(g)) for g in plan.gathered),
    )


def _gathered(plan: Plan) -> tuple[dict, dict[int, float]]:
    """Per plan index of a gathered piece: what it shows as (the first piece: the group's
    (span, shape), `_span`; the others None: they orthogonalize nothing) and the bytes its
    all-to-alls move per step (the first piece's holder: the others' pieces, both ways; another
    piece's: its own)."""
    shown: dict = {}
    moved: dict[int, float] = {}
    for g in plan.gathered:
        idx = [plan._index(p) for p in g]
        sizes = [MASTER_BYTES * math.prod(plan.shapes[i]) for i in idx]
        shape = covered(plan, g)[0]
        shown[idx[0]], moved[idx[0]] = (_span(plan, g), shape), 2.0 * (sum(sizes) - sizes[0])
        for i, b in zip(idx[1:], sizes[1:], strict=True):
            shown[i], moved[i] = None, 2.0 * b
    return shown, moved


def _sliced(plan: Plan) -> tuple[tuple[str, int], ...]:
    """(parameter, its pieces) per parameter the slicer cut: a gathered group counts as the
    one unit it was cut from (`Plan.units`; a whole matrix cut only by §12 is not listed)."""
    counts = ((n, len(plan.units(n))) for n, _ in plan.sliced)
    return tuple((n, k) for n, k in counts if k > 1)


def _span(plan: Plan, group: tuple[str, ...]) -> str:
    """A gathered group's name: its parameter's if it holds all of it, else `name[a:b]`."""
    first, last = parse_piece(group[0]), parse_piece(group[-1])
    if tuple(group) == plan.pieces(first.param):
        return first.param
    return piece_name(first.param, first.start, last.stop, first.dim, first.outer)


def measure_gemm_flops(
    device: torch.device | str | None = None, dtype: torch.dtype | None = None, n: int | None = None
) -> float:
    """FLOP/s of an n×n GEMM (best of 3 after a warm-up) on `device` (default: the current CUDA
    device, else the CPU) in `dtype` (default: its NS iteration dtype); n defaults to 1024 on a
    CPU, 8192 on CUDA."""
    device = _default_device() if device is None else torch.device(device)
    if device.type not in ("cpu", "cuda"):
        raise ValueError(
            f"measure_gemm_flops runs on 'cpu' or 'cuda', got {device}: pass plan_summary a "
            "gemm_flops figure instead"
        )
    check_dtype("dtype", dtype)
    dtype = iteration_dtype(device) if dtype is None else dtype
    n = (8192 if device.type == "cuda" else 1024) if n is None else _check_int("n", n, 1)
    a, b = (torch.randn(n, n, device=device).to(dtype) for _ in range(2))
    c = torch.empty(n, n, device=device, dtype=dtype)

    def gemm() -> None:
        torch.mm(a, b, out=c)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    return 2.0 * n**3 / race({"gemm": gemm})["gemm"]
