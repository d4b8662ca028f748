"""The functional API: plan / init / value_and_grad / update, one whole step under
torch.compile(fullgraph=True).

    plan  = dmuon_fn.plan(model, mesh)                        # pure, from shapes
    state = dmuon_fn.init(model, plan, dmuon_fn.Config())     # pytree of tensors
    @torch.compile(fullgraph=True)
    def train_step(state, batch, lr):
        loss, grads = dmuon_fn.value_and_grad(loss_fn, plan)(state.params, batch)
        return loss, dmuon_fn.update(grads, state, lr=lr)

Every parameter is dedicated (FSDP2's hooks cannot be traced in torch 2.13): matrices matched by
`predicate` take Muon, the rest AdamW, each on its one global owner. `state.params[name]` is the
full parameter on its local owners and a 0-size placeholder elsewhere; dmuon::owner_broadcast
gathers every parameter before the differentiated loss, and dmuon::two_stage_reduce (its
transpose) leaves the data-parallel mean gradient on the global owner (zeros shaped like the
slot elsewhere). Given stages [(names, fn), ...] instead of one loss, value_and_grad gathers per
stage and again in backward (Z3, dmuon_fn.functional._z3). Under HSDP `update` publishes the new
values to the other replicas' local owners.
Rank-specific choices (who owns what) are Python constants of the plan, so each rank compiles
its own graph once; lr, weight decay and step counts are 0-d tensors and never recompile.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from ..comm._mesh import check_dtypes, check_meshes, master_dtype
from ..dedicated import _fsdp_adapter as fsdp
from ..ns._dispatch import agreed_aspect, gram_min_aspect, setup_field
from ..ns._orthogonalize import NSConfig
from ..optim import _guard as guard
from ..optim._update import AdamWState, MuonState, adamw_init, adamw_update, muon_init, muon_update
from ..planning._check import check_plan_consistent, check_setup_consistent, kernel_field
from ..planning._partition import partition
from ..planning._view import RankView
from ._plan import FnPlan
from ._z3 import Stage, _flat, _gather, _reduce, staged_value_and_grad


@dataclass(frozen=True)
class Config:
    """Hyperparameters. `lr` and `adamw_lr` are the defaults of `update`'s per-step arguments
    (pass them there as tensors to schedule without recompiling); a checkpoint records them with
    the rest (dmuon_fn._checkpoint)."""

    momentum: float = 0.95
    nesterov: bool = True
    weight_decay: float = 0.0
    adamw_betas: tuple[float, float] = (0.9, 0.999)
    adamw_eps: float = 1e-8
    adamw_weight_decay: float = 0.01
    adjust_lr: str = "match_rms_adamw"
    ns: NSConfig = field(default_factory=NSConfig)
    state_dtype: torch.dtype = torch.float32
    max_grad_norm: float | None = None  # clip every gradient by the global norm
    nonfinite: str = "skip"  # "skip": a non-finite gradient anywhere leaves the state unchanged
    lr: float = 0.02
    adamw_lr: float | None = None  # None: lr

    def __post_init__(self) -> None:
        for name in ("lr", "adamw_lr", "momentum", "weight_decay", "adamw_eps"):
            value = getattr(self, name)
            if value is not None and not value >= 0.0:
                raise ValueError(f"Config.{name} must be >= 0, got {value!r}")
        if not all(0.0 <= b < 1.0 for b in self.adamw_betas):
            raise ValueError(f"Config.adamw_betas must lie in [0, 1), got {self.adamw_betas!r}")
        guard.check_max_norm(self.max_grad_norm)
        if self.nonfinite not in ("skip", "ignore"):
            raise ValueError(
                f"Config.nonfinite must be 'skip' or 'ignore' (a compiled step cannot raise "
                f"without a host sync), got {self.nonfinite!r}"
            )


class State(NamedTuple):
    """params: the master on each parameter's global owner (in the model dtype, or promoted to at
    least fp32 under `plan(param_dtype=...)`), the `param_dtype` copy on the other replicas'
    local owners, 0-size elsewhere. The counters, as the object API's: steps skipped for a
    non-finite gradient (int64) and the last global gradient norm taken (float32), 0-d on every
    rank; `update` maintains them when it takes the norm (None: not counted)."""

    params: dict[str, torch.Tensor]
    opt: dict[str, MuonState | AdamWState]
    plan: FnPlan
    config: Config
    skipped_steps: torch.Tensor | None = None
    grad_norm: torch.Tensor | None = None


def plan(
    model: nn.Module,
    mesh: DeviceMesh | None = None,
    predicate: Callable[[str, nn.Parameter], bool] | None = None,
    *,
    replicate_mesh: DeviceMesh | None = None,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
) -> FnPlan:
    """Plan ownership of every parameter of `model` (names in `named_parameters()` order).

    mesh None: one process. predicate(name, param) selects the Muon matrices (default: every
    parameter with 2+ dims); the rest take AdamW.
    param_dtype / reduce_dtype: mixed precision, as `dedicate_params`: every parameter is
    gathered and computed with in `param_dtype` (e.g. bf16) while its global owner keeps the
    master in the model dtype promoted to at least fp32 (and the optimizer state in
    `Config.state_dtype`); gradients are summed in `reduce_dtype` (default: param_dtype's).
    None (default): the model dtype throughout, no separate master.
    """
    check_dtypes(param_dtype, reduce_dtype)
    named = list(model.named_parameters())
    if not named:
        raise ValueError("the model has no parameters to plan")
    split = [n for n, p in named if fsdp.is_dtensor(p)]
    if split:
        raise ValueError(
            f"{split[0]} is a DTensor ({len(split)} in all): the functional API plans plain "
            "tensors. For tensor parallelism use the object API (parallelize_module, then "
            "dedicate_params and Muon)"
        )
    predicate = predicate or (lambda n, p: p.ndim >= 2)
    muon = frozenset(n for n, p in named if predicate(n, p))
    bad = [n for n in muon if dict(named)[n].ndim < 2]
    if bad:
        raise ValueError(f"{bad[0]} is not a matrix: the predicate must select 2+-dim params")
    if mesh is None:
        if replicate_mesh is not None:
            raise ValueError("replicate_mesh needs a shard mesh too")
        G, R, shard_rank, rep_rank, group, rep_group = 1, 1, 0, 0, "", ""
    else:
        check_meshes(mesh, replicate_mesh)
        G, shard_rank, group = mesh.size(), mesh.get_local_rank(), mesh.get_group().group_name
        R = 1 if replicate_mesh is None else replicate_mesh.size()
        rep_rank = 0 if replicate_mesh is None else replicate_mesh.get_local_rank()
        rep_group = "" if replicate_mesh is None else replicate_mesh.get_group().group_name
    shapes = {n: tuple(p.shape) for n, p in named}
    device = named[0][1].device
    # a job plans (and runs) rank 0's NS dispatch on every rank
    aspect = agreed_aspect(device) if G * R > 1 else gram_min_aspect(device)
    part = partition(
        shapes,
        G * R,
        replicate_size=R,
        elementwise=[n for n in shapes if n not in muon],
        gram_min_aspect=aspect,
    )
    if dist.is_initialized() and G * R > 1:
        check_plan_consistent(part)
    return FnPlan(
        names=tuple(n for n, _ in named),
        shapes=tuple(shapes[n] for n, _ in named),
        muon=muon,
        trainable=frozenset(n for n, p in named if p.requires_grad),
        view=RankView(part, shard_rank, rep_rank),
        group=group,
        rep_group=rep_group,
        param_dtype=param_dtype,
        reduce_dtype=reduce_dtype,
    )


def init(model: nn.Module, fn_plan: FnPlan, config: Config | None = None) -> State:
    """Parameters and optimizer state for this rank: real where it owns, 0-size elsewhere (see
    `State`)."""
    config = config or Config()
    params, opt = {}, {}
    named = dict(model.named_parameters())
    for name in fn_plan.names:
        p = named[name].detach()
        params[name] = local = _held(p, name, fn_plan)
        like = local if fn_plan.is_global_owner(name) else local.new_empty(0)
        init_state = muon_init if name in fn_plan.muon else adamw_init
        opt[name] = init_state(like, dtype=config.state_dtype)
    device = next(iter(params.values())).device
    kernel, error = kernel_field(config.ns.kernel, device)
    if fn_plan.shard_size * fn_plan.replicate_size > 1:
        check_setup_consistent(
            {"NS kernel": kernel, "NS dispatch": setup_field(device), "Config": repr(config)}
        )
    if error is not None:
        raise error
    counters = guard.counters(device)
    return State(params, opt, fn_plan, config, *counters)


def _held(p: torch.Tensor, name: str, fn_plan: FnPlan) -> torch.Tensor:
    """What this rank holds of parameter `p` (`State.params`)."""
    dt = fn_plan.param_dtype
    if dt is None:
        return p.clone() if fn_plan.is_local_owner(name) else p.new_empty(0)
    if fn_plan.is_global_owner(name):
        return p.to(master_dtype(p.dtype), copy=True)
    return p.to(dt, copy=True) if fn_plan.is_local_owner(name) else p.new_empty(0, dtype=dt)


def gather_all(params: dict[str, torch.Tensor], fn_plan: FnPlan) -> dict[str, torch.Tensor]:
    """Every parameter in full on every rank of its shard group, in one call (name order)."""
    return _gather(params, fn_plan.names, fn_plan)[0]


def reduce_all(grads: dict[str, torch.Tensor], fn_plan: FnPlan) -> dict[str, torch.Tensor]:
    """Full-shape gradients -> the data-parallel mean on each global owner, zeros shaped like
    the local slot elsewhere, in one call."""
    return _reduce(grads, fn_plan.names, fn_plan)[0]


def value_and_grad(
    loss_fn: Callable[[dict[str, torch.Tensor], Any], torch.Tensor] | Sequence[Stage],
    fn_plan: FnPlan,
    *,
    prefetch: int = 1,
) -> Callable[[dict[str, torch.Tensor], Any], tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    """(params, batch) -> (this rank's loss, grads): loss_fn sees full parameters; each grad is
    the data-parallel mean on the parameter's global owner, zeros shaped like the slot elsewhere.

    loss_fn(params, batch) -> loss (Z2-like): the gather runs before and the reduce after the
    differentiated function, each as one op over every parameter: a graph scheduler may reorder
    independent nodes differently on ranks whose graphs differ (owners and non-owners), which
    would mismatch per-parameter collectives. Every gathered parameter lives for the whole step.

    A sequence of stages [(names, fn), ...], fn(params, x, batch) -> x (x None for the first
    stage, the loss from the last), runs Z3: each stage's parameters are gathered for its
    forward, freed, and gathered again for its backward (dmuon_fn.functional._z3); the results
    equal the Z2 form's to fp32 rounding. prefetch=1 (default): each stage's gathers and
    reduces are issued one stage ahead and overlap its neighbour's computation (two adjacent
    stages' copies at a time); 0: issued when needed, blocking (one stage at a time).
    """
    if not callable(loss_fn):
        return staged_value_and_grad(loss_fn, fn_plan, prefetch)

    def run(params: dict[str, torch.Tensor], batch: Any):
        full = gather_all(params, fn_plan)
        grads, loss = torch.func.grad_and_value(lambda f: loss_fn(f, batch))(full)
        return loss, reduce_all(grads, fn_plan)

    return run


def update(
    grads: dict[str, torch.Tensor],
    state: State,
    *,
    lr: torch.Tensor | float | None = None,
    adamw_lr: torch.Tensor | float | None = None,
    weight_decay: torch.Tensor | float | None = None,
    adamw_weight_decay: torch.Tensor | float | None = None,
) -> State:
    """One optimizer step (pure): Muon or AdamW on the parameters this rank owns (on the
    masters under mixed precision), then (HSDP) the publish to the other replicas, in
    `param_dtype`. Each argument left None takes the Config's value (adamw_lr: Config.adamw_lr,
    else lr).

    With `Config.max_grad_norm` the gradients are first clipped by the global norm; with
    `Config.nonfinite="skip"` (default) a non-finite gradient anywhere returns every parameter
    and all optimizer state unchanged on every rank (masked on device), counted in
    `State.skipped_steps`. Either costs one in-graph all-reduce of a float64 scalar per mesh
    dimension (`global_grad_norm`) and records the norm in `State.grad_norm`."""
    p_, cfg = state.plan, state.config
    lr = cfg.lr if lr is None else lr
    if adamw_lr is None:
        adamw_lr = lr if cfg.adamw_lr is None else cfg.adamw_lr
    wd = cfg.weight_decay if weight_decay is None else weight_decay
    awd = cfg.adamw_weight_decay if adamw_weight_decay is None else adamw_weight_decay
    ok, sq = None, None
    skipped, norm = state.skipped_steps, state.grad_norm
    if cfg.max_grad_norm is not None or cfg.nonfinite == "skip":
        sq = _global_sq(grads, p_)
        if cfg.max_grad_norm is not None:
            coef = guard.clip_coefficient(sq.sqrt(), cfg.max_grad_norm)
            grads = {n: g * coef.to(g.dtype) for n, g in grads.items()}
        ok = torch.isfinite(sq) if cfg.nonfinite == "skip" else None
        norm = None if norm is None else sq.sqrt().to(norm.dtype)
        if ok is not None and skipped is not None:
            skipped = skipped + (~ok).to(skipped.dtype)
    params, opt = dict(state.params), dict(state.opt)
    for name in p_.names:
        if not (p_.is_global_owner(name) and name in p_.trainable):
            continue
        if name in p_.muon:
            new = muon_update(
                params[name],
                grads[name],
                opt[name],
                lr=lr,
                weight_decay=wd,
                momentum=cfg.momentum,
                nesterov=cfg.nesterov,
                adjust_lr=cfg.adjust_lr,
                ns=cfg.ns,
            )
        else:
            new = adamw_update(
                params[name],
                grads[name],
                opt[name],
                lr=adamw_lr,
                betas=cfg.adamw_betas,
                eps=cfg.adamw_eps,
                weight_decay=awd,
            )
        params[name], opt[name] = _keep_if_skipped(ok, new, (params[name], opt[name]))
    mine = [n for n in p_.names if p_.is_local_owner(n)]
    if p_.replicate_size > 1 and mine:
        # one publish over the replicate group (whose ranks all hold the same `mine`), ordered
        # after this step's gradient reduce through `after`
        routes = [(r[3], r[4], r[5], 0, 1, 1) for r in (p_.route(n) for n in mine)]
        outs = torch.ops.dmuon.owner_broadcast(
            [p_.compute(params[n]) for n in mine],
            _flat(p_.shape(n) for n in mine),
            [len(p_.shape(n)) for n in mine],
            _flat(routes),
            p_.rep_group,
            # and after the guard's all-reduce on the same group: a rank that updates nothing
            # would otherwise have the two collectives unordered in its graph
            after=[grads[n] for n in p_.names] + ([] if sq is None else [sq]),
        )
        # the other replicas take the published copy; the global owner keeps its master
        params.update((n, o) for n, o in zip(mine, outs, strict=True) if not p_.is_global_owner(n))
    return State(params, opt, p_, cfg, skipped, norm)


def global_grad_norm(grads: dict[str, torch.Tensor], fn_plan: FnPlan) -> torch.Tensor:
    """‖all gradients‖ of the job (float64, 0-d, every rank), from `value_and_grad`'s grads:
    each value lives on its global owner only (zeros elsewhere), so the sums over the shard and
    replicate groups count each entry once (proofs/guard.md). In-graph, under compile too."""
    return _global_sq(grads, fn_plan).sqrt()


def _global_sq(grads: dict[str, torch.Tensor], fn_plan: FnPlan) -> torch.Tensor:
    """Σ‖g‖² over the trainable parameters (`update` leaves the rest as they are), every rank
    issuing the same all-reduces whatever it owns."""
    device = grads[fn_plan.names[0]].device
    gs = [grads[n] for n in fn_plan.names if n in fn_plan.trainable]
    sq = guard.squared_norms(gs, device).sum()
    for size, group in (
        (fn_plan.shard_size, fn_plan.group),
        (fn_plan.replicate_size, fn_plan.rep_group),
    ):
        if size > 1:
            sq = funcol.all_reduce(sq, "sum", group)
    return sq


def _keep_if_skipped(ok: torch.Tensor | None, new: tuple, old: tuple) -> tuple:
    """`new` (param, optimizer state), or `old` where `ok` is False: a masked write, no sync."""
    if ok is None:
        return new
    param = torch.where(ok, new[0], old[0])
    state = type(new[1])(*(torch.where(ok, a, b) for a, b in zip(new[1], old[1], strict=True)))
    return param, state


def full_params(state: State) -> dict[str, torch.Tensor]:
    """Every parameter's full value on every rank (for checks and export; one broadcast each)."""
    with torch.no_grad():
        return gather_all(state.params, state.plan)
