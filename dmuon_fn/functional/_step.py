"""The functional API: plan / init / value_and_grad / update, one whole step under
torch.compile(fullgraph=True) (docs/functional.md). Every parameter is dedicated to one global
owner; who owns what is a constant of the plan, so each rank compiles its graph once; lr, weight
decay and step counts are 0-d tensors (proofs/step_notes.md)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn as nn

from ..comm._mesh import master_dtype
from ..optim import _guard as guard
from ..optim._config import Config, check_nonfinite
from ..optim._update import AdamWState, MuonState, init_state, param_update
from ._plan import FnPlan
from ._z3 import Stage, _flat, _gather, _reduce, staged_value_and_grad


class State(NamedTuple):
    """params: the master on each parameter's global owner (model dtype, at least fp32 under
    `param_dtype`), the `param_dtype` copy on other replicas' local owners, 0-size elsewhere.
    skipped_steps (int64), grad_norm (float32): 0-d on every rank, as `Muon`'s; `update`
    maintains them when it takes the norm (None: not counted)."""

    params: dict[str, torch.Tensor]
    opt: dict[str, MuonState | AdamWState]
    plan: FnPlan
    config: Config
    skipped_steps: torch.Tensor | None = None
    grad_norm: torch.Tensor | None = None


def init(model: nn.Module, fn_plan: FnPlan, config: Config | None = None) -> State:
    """This rank's `State`: real where it owns, 0-size elsewhere."""
    config = config or Config()
    params, opt = {}, {}
    named = dict(model.named_parameters())
    for name in fn_plan.names:
        params[name] = local = _held(named[name].detach(), name, fn_plan)
        like = local if fn_plan.is_global_owner(name) else local.new_empty(0)
        kind = "muon" if name in fn_plan.muon else "adamw"
        opt[name] = init_state(kind, like, config.state_dtype)
    device = next(iter(params.values())).device
    config.check_setup(device, across_ranks=fn_plan.shard_size * fn_plan.replicate_size > 1)
    return State(params, opt, fn_plan, config, *guard.counters(device))


def _held(p: torch.Tensor, name: str, fn_plan: FnPlan) -> torch.Tensor:
    """What this rank holds of parameter `p` (`State.params`)."""
    dt = fn_plan.param_dtype
    if dt is None:
        return p.clone() if fn_plan.is_local_owner(name) else p.new_empty(0)
    if fn_plan.is_global_owner(name):
        return p.to(master_dtype(p.dtype), copy=True)
    return p.to(dt, copy=True) if fn_plan.is_local_owner(name) else p.new_empty(0, dtype=dt)


def value_and_grad(
    loss_fn: Callable[[dict[str, torch.Tensor], Any], torch.Tensor] | Sequence[Stage],
    fn_plan: FnPlan,
    *,
    prefetch: int = 1,
) -> Callable[[dict[str, torch.Tensor], Any], tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    """(params, batch) -> (this rank's loss, grads): each grad the data-parallel mean on the
    parameter's global owner, zeros shaped like the slot elsewhere. loss_fn(params, batch) -> loss
    sees every parameter in full (Z2: one gather before, one reduce after). Stages [(names, fn),
    ...], fn(params, x, batch) -> x (x None for the first, the loss from the last) run Z3, equal to
    Z2 to fp32 rounding: prefetch=1 holds two adjacent stages' copies and overlaps, 0 one's."""
    if not callable(loss_fn):
        return staged_value_and_grad(loss_fn, fn_plan, prefetch)

    def run(params: dict[str, torch.Tensor], batch: Any):
        full = _gather(params, fn_plan.names, fn_plan)[0]
        grads, loss = torch.func.grad_and_value(lambda f: loss_fn(f, batch))(full)
        return loss, _reduce(grads, fn_plan.names, fn_plan)[0]

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
    """One pure step: Muon or AdamW on the parameters this rank owns (the masters under mixed
    precision), then (HSDP) the publish to the other replicas in `param_dtype`. Arguments left
    None take `Config.groups()`'s; pass tensors to schedule without recompiling. The guard
    (`Config.max_grad_norm`, `nonfinite`) costs one in-graph float64 all-reduce per mesh
    dimension and updates the State's counters."""
    p_, cfg = state.plan, state.config
    check_nonfinite(cfg.nonfinite, host_sync=False)
    hyper = cfg.groups(
        lr=lr, adamw_lr=adamw_lr, weight_decay=weight_decay, adamw_weight_decay=adamw_weight_decay
    )
    ok, sq, skipped, norm = None, None, state.skipped_steps, state.grad_norm
    if cfg.guarded:
        sq = _global_sq(grads, p_)
        verdict = guard.judge(sq, sq, cfg.nonfinite, cfg.max_grad_norm)
        if verdict.coef is not None:
            grads = {n: g * verdict.coef.to(g.dtype) for n, g in grads.items()}
        ok = verdict.ok
        norm = None if norm is None else verdict.norm.to(norm.dtype)
        skipped = None if skipped is None else guard.tally(skipped, ok)
    params, opt = dict(state.params), dict(state.opt)
    for n in p_.names:
        if not (p_.is_global_owner(n) and n in p_.trainable):
            continue
        kind = "muon" if n in p_.muon else "adamw"
        new, s = param_update(
            kind, params[n], grads[n], opt[n], hyper[kind], adjust_lr=cfg.adjust_lr, ns=cfg.ns
        )
        params[n] = guard.keep(ok, new, params[n])
        opt[n] = type(s)(*(guard.keep(ok, a, b) for a, b in zip(s, opt[n], strict=True)))
    mine = [n for n in p_.names if p_.is_local_owner(n)]
    if p_.replicate_size > 1 and mine:
        # one publish over the replicate group (whose ranks all hold the same `mine`), after this
        # step's gradient reduce and the guard's all-reduce on that group: a rank that updates
        # nothing would otherwise have the collectives unordered in its graph
        routes = [(r[3], r[4], r[5], 0, 1, 1) for r in map(p_.route, mine)]
        outs = torch.ops.dmuon.owner_broadcast(
            [p_.compute(params[n]) for n in mine],
            _flat(p_.shape(n) for n in mine),
            [len(p_.shape(n)) for n in mine],
            _flat(routes),
            p_.rep_group,
            after=[grads[n] for n in p_.names] + ([] if sq is None else [sq]),
        )
        # the other replicas take the published copy; the global owner keeps its master
        params.update((n, o) for n, o in zip(mine, outs, strict=True) if not p_.is_global_owner(n))
    return State(params, opt, p_, cfg, skipped, norm)


def global_grad_norm(grads: dict[str, torch.Tensor], fn_plan: FnPlan) -> torch.Tensor:
    """‖all gradients‖ of the job (float64, 0-d, every rank; in-graph) from `value_and_grad`'s
    grads (proofs/guard.md)."""
    return _global_sq(grads, fn_plan).sqrt()


def _global_sq(grads: dict[str, torch.Tensor], fp: FnPlan) -> torch.Tensor:
    """Σ‖g‖² over the trainable parameters; every rank issues the same all-reduces."""
    gs = [grads[n] for n in fp.names if n in fp.trainable]
    sq = guard.squared_norms(gs, grads[fp.names[0]].device).sum()
    for size, group in ((fp.shard_size, fp.group), (fp.replicate_size, fp.rep_group)):
        if size > 1:
            sq = funcol.all_reduce(sq, "sum", group)
    return sq


def full_params(state: State) -> dict[str, torch.Tensor]:
    """Every parameter's full value on every rank (for checks and export)."""
    with torch.no_grad():
        return _gather(state.params, state.plan.names, state.plan)[0]
