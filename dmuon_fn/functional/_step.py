"""The functional step: init / value_and_grad / update, one whole step under
torch.compile(fullgraph=True) (docs/functional.md); Z3 (staged) gathers each stage for its forward
and again for its backward (proofs/step_notes.md, proofs/prefetch.md, proofs/dedicate.md)."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
from torch.utils._pytree import tree_leaves

from ..comm._mesh import master_dtype
from ..dedicated._init import held_values
from ..optim import _guard as guard
from ..optim._config import Config, check_nonfinite
from ..optim._qk_clip import check_clip_heads, clip_params, stacked_maxes
from ..optim._update import AdamWState, MuonState, init_state, param_update
from ..planning._slices import take
from ._collect import (
    flat,
    full_rows,
    gather_params,
    joined,
    local_rows,
    owner_entries,
    reduce_grads,
)
from ._plan import FnPlan

StageFn = Callable[[dict[str, torch.Tensor], Any, Any], Any]
Stage = tuple[Sequence[str], StageFn]


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


def init(
    model: nn.Module,
    fn_plan: FnPlan,
    config: Config | None = None,
    *,
    init_fn: Callable[[nn.Module], None] | None = None,
    seed: int | None = None,
    device: torch.device | str | None = None,
) -> State:
    """This rank's `State`: real where it owns, 0-size elsewhere.

    A model built on the meta device: pass `init_fn` (as `init_weights`'s `fn`), `seed` and
    `device`; only what this rank holds is computed (each value as `init_weights(model,
    init_fn, seed=seed)` gives it on one process, whatever the world size), the model's buffers
    get storage and values on `device`, its parameters stay on meta."""
    config = config or Config()
    matrices = {n: fn_plan.shape(n) for n in fn_plan.muon}
    check_clip_heads(config.qk_clip_heads, matrices, fn_plan.partition.teams)
    params, opt = {}, {}
    named = {n: p.detach() for n, p in model.named_parameters()}
    if any(p.is_meta for p in named.values()):
        named = _materialized(model, named, fn_plan, init_fn, seed, device)
    elif init_fn is not None or seed is not None:
        raise ValueError(
            "init_fn and seed are for a model on the meta device; this one has values "
            "(dmuon_fn.init_weights(model, fn, seed=...) initializes it in place)"
        )
    for name in fn_plan.names:
        whole, pieces = named[name], fn_plan.pieces([name])
        held = [
            take(whole, p) for _, p in pieces if len(pieces) > 1 and fn_plan.view.is_local_owner(p)
        ]
        params[name] = local = _held(held[0] if held else whole, name, fn_plan)
        like = local if fn_plan.is_global_owner(name) else local.new_empty(0)
        kind = "muon" if name in fn_plan.muon else "adamw"
        opt[name] = init_state(kind, like, config.state_dtype)
    device = next(iter(params.values())).device
    config.check_setup(device, across_ranks=fn_plan.shard_size * fn_plan.replicate_size > 1)
    return State(params, opt, fn_plan, config, *guard.counters(device))


def _materialized(model, named, fn_plan: FnPlan, init_fn, seed, device) -> dict:
    """`named` ({name: meta tensor}) with the values of the parameters this rank holds."""
    if init_fn is None or seed is None or device is None:
        raise ValueError(
            "the model is on the meta device: pass init(model, plan, config, init_fn=fn, "
            "seed=..., device=...) so that this rank computes the values it holds (fn(module) "
            "as for model.apply, e.g. lambda m: getattr(m, 'reset_parameters', lambda: None)())"
        )
    real = [n for n, p in named.items() if not p.is_meta]
    if real:
        raise ValueError(
            f"{real[0]} has a value in a model on the meta device: build every parameter "
            "under torch.device('meta'), or none"
        )
    held = {n for n in fn_plan.names if fn_plan.is_local_owner(n)}
    values = held_values(model, held, init_fn, seed=seed, device=torch.device(device))
    # what others hold: a full-shape view of one element (nothing is read from it)
    nothing = {
        n: torch.empty((), dtype=p.dtype, device=device).expand(p.shape) for n, p in named.items()
    }
    return {n: values[n] if n in held else nothing[n] for n in named}


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
    has_aux: bool = False,
) -> Callable[[dict[str, torch.Tensor], Any], tuple[Any, dict[str, torch.Tensor]]]:
    """(params, batch) -> (this rank's loss, grads): each grad the data-parallel mean on the
    parameter's global owner, zeros shaped like the slot elsewhere. loss_fn(params, batch) -> loss
    sees every parameter in full (Z2: one gather before, one reduce after). Stages [(names, fn),
    ...], fn(params, x, batch) -> x (x None for the first, the loss from the last) run Z3, equal to
    Z2 to fp32 rounding: prefetch=1 holds two adjacent stages' copies and overlaps, 0 one's.
    has_aux (Z2): loss_fn returns (loss, aux), the result ((loss, aux), grads); aux is how values
    made in the forward leave it (e.g. a LogitTracker's `maxima()` for QK-clip)."""
    if not callable(loss_fn):
        if has_aux:
            raise ValueError("has_aux=True takes one loss_fn (Z2), not stages")
        return staged_value_and_grad(loss_fn, fn_plan, prefetch)

    def run(params: dict[str, torch.Tensor], batch: Any):
        full = gather_params(params, fn_plan.names, fn_plan)[0]
        fn = torch.func.grad_and_value(lambda f: loss_fn(f, batch), has_aux=has_aux)
        grads, loss = fn(full)
        return loss, reduce_grads(grads, fn_plan.names, fn_plan)[0]

    return run


def update(
    grads: dict[str, torch.Tensor],
    state: State,
    *,
    lr: torch.Tensor | float | None = None,
    adamw_lr: torch.Tensor | float | None = None,
    weight_decay: torch.Tensor | float | None = None,
    adamw_weight_decay: torch.Tensor | float | None = None,
    max_logits: Mapping[Hashable, torch.Tensor] | None = None,
) -> State:
    """One pure step: Muon or AdamW on the parameters this rank owns (the masters under mixed
    precision), then (HSDP) the publish to the other replicas in `param_dtype`. Arguments left
    None take `Config.groups()`'s; pass tensors to schedule without recompiling. The guard
    (`Config.max_grad_norm`, `nonfinite`): one float64 all-reduce per mesh dimension.
    max_logits: {key: per-head max logits} (a LogitTracker's) when `Config.qk_clip_heads` is set:
    MAX-reduced in the graph, then the owners of those weights clip them."""
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
    for n in [n for n in p_.names if p_.is_global_owner(n) and n in p_.trainable]:
        kind = "muon" if n in p_.muon else "adamw"
        new, s = param_update(
            kind,
            params[n],
            grads[n],
            opt[n],
            hyper[kind],
            adjust_lr=cfg.adjust_lr,
            ns=cfg.ns,
            blocks=p_.partition.blocks_of(n),
            team=p_.team(n),
        )
        params[n] = guard.keep(ok, new, params[n])
        opt[n] = type(s)(*(guard.keep(ok, a, b) for a, b in zip(s, opt[n], strict=True)))
    maxes = None
    if cfg.qk_clip_heads:  # after the update, before the publish: on the global owners
        if max_logits is None:
            raise ValueError("Config.qk_clip_heads is set: pass update(..., max_logits={key: max})")
        maxes = stacked_maxes(cfg.qk_clip_heads, max_logits, grads[p_.names[0]].device)
        for size, group in ((p_.shard_size, p_.group), (p_.replicate_size, p_.rep_group)):
            if size > 1:
                maxes = funcol.all_reduce(maxes, "max", group)
        held = {n: params[n] for _, h in cfg.qk_clip_heads for n in (h.q, h.k)}
        held = {n: v for n, v in held.items() if p_.is_global_owner(n)}
        clip = (cfg.qk_clip_heads, maxes, cfg.qk_clip_tau, cfg.qk_clip_alpha)
        for n, v in clip_params(*clip, held).items():
            params[n] = guard.keep(ok, v, params[n])
    mine = [n for n in p_.names if p_.is_local_owner(n)]
    if p_.replicate_size > 1 and mine:
        # one publish over the replicate group (its ranks hold the same `mine`), after the step's
        # other collectives on that group: else a rank that updates nothing leaves them unordered
        routes = [(r[3], r[4], r[5], 0, 1, 1) for r in (p_.route(p_.view.held(n)) for n in mine)]
        values = [p_.compute(params[n]) for n in mine]
        outs = torch.ops.dmuon.owner_broadcast(
            *owner_entries(values, [p_.held_shape(n) for n in mine], routes),
            p_.rep_group,
            after=[grads[n] for n in p_.names] + [x for x in (sq, maxes) if x is not None],
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
        return gather_params(state.params, state.plan.names, state.plan)[0]


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _vjp(fn: StageFn, full, x, batch):
    """(output, pullback): the pullback maps the output's cotangent to (param grads, x's)."""
    if x is None:
        out, pull = torch.func.vjp(lambda f: fn(f, None, batch), full)
        return out, lambda cot: (pull(cot)[0], None)
    return torch.func.vjp(lambda f, a: fn(f, a, batch), full, x)


class _Blocking:
    """prefetch=0: each gather and reduce one blocking op where needed, in a token chain."""

    def __init__(self, params, fn_plan: FnPlan) -> None:
        self.params, self.plan = params, fn_plan
        self.token = params[fn_plan.names[0]].new_zeros(0)

    def start_gather(self, names):
        return names  # issued by `gathered`, where the result is needed

    def gathered(self, names, after):
        full, self.token = gather_params(self.params, names, self.plan, self.token, after)
        return full

    def start_reduce(self, g_full, names):
        reduced, self.token = reduce_grads(g_full, names, self.plan, self.token)
        return reduced

    def reduced(self, reduced, last: bool):
        return reduced


class _Overlapped:
    """prefetch=1: every gather and reduce started ahead, each start taking the previous start's
    ticket and each reduce's wait the previous wait's results."""

    def __init__(self, params, fn_plan: FnPlan) -> None:
        self.params, self.plan = params, fn_plan
        self.chain = params[fn_plan.names[0]].new_zeros(0)
        self.landed: list[torch.Tensor] = []
        # 0-size tensors in each output's dtype, for the waits
        self.like = {n: fn_plan.compute(params[n].new_empty(0)) for n in fn_plan.names}

    def start_gather(self, names):
        self.chain = gather_params(self.params, names, self.plan, after=[self.chain], start=True)
        return self.chain, names

    def gathered(self, handle, after):
        ticket, names = handle
        pieces = self.plan.pieces(names)
        likes = [self.like[n] for n, _ in pieces]
        outs = self._wait(ticket, likes, full_rows(pieces, self.plan), after)
        return joined(pieces, outs, self.plan, gathered=True)

    def start_reduce(self, g_full, names):
        self.chain = reduce_grads(g_full, names, self.plan, after=[self.chain], start=True)
        pieces = self.plan.pieces(names)
        return self.chain, pieces, [self.plan.summed(g_full[n].new_empty(0)) for n, *_ in pieces]

    def reduced(self, handle, last: bool):
        ticket, pieces, likes = handle
        after = self.landed if last else [self.chain, *self.landed]
        outs = self._wait(ticket, likes, local_rows(pieces, self.plan), after)
        self.landed = list(outs)
        return joined(pieces, outs, self.plan, gathered=False)

    @staticmethod
    def _wait(ticket, likes, rows, after):
        """The results behind `ticket`; `likes[i]` has output i's dtype and device."""
        ndims = [len(r) for r in rows]
        return torch.ops.dmuon.collective_wait(ticket, likes, flat(rows), ndims, after=after)


def staged_value_and_grad(stages: Sequence[Stage], fn_plan: FnPlan, prefetch: int = 1):
    """`value_and_grad` over stages. A name in several stages (tied weights) has its gradient
    reduced after each and summed on the owner."""
    if not stages:
        raise ValueError("stages is empty: pass [(names, fn), ...], the last returning the loss")
    checked, seen = [], set()
    for i, stage in enumerate(stages):
        if not (isinstance(stage, tuple | list) and len(stage) == 2 and callable(stage[1])):
            raise ValueError(f"stage {i} must be a (names, fn) pair, got {stage!r}")
        names = tuple(stage[0])
        unknown = [n for n in names if n not in fn_plan.names]
        if unknown:
            raise ValueError(f"stage {i} names {unknown[0]!r}, which the plan does not hold")
        if len(set(names)) != len(names) or not names:
            raise ValueError(f"stage {i} must name its parameters once each, got {names}")
        seen.update(names)
        checked.append((names, stage[1]))
    missing = [n for n in fn_plan.names if n not in seen]
    if missing:
        raise ValueError(f"{missing[0]!r} is in no stage: every planned parameter needs one")
    stages = tuple(checked)
    if prefetch not in (0, 1):
        raise ValueError(f"prefetch must be 0 or 1 (one stage ahead), got {prefetch!r}")

    def run(params: dict[str, torch.Tensor], batch: Any):
        ops = (_Overlapped if prefetch else _Blocking)(params, fn_plan)
        xs, x, last = [], None, len(stages) - 1
        handle = ops.start_gather(stages[0][0])
        for i, (_, fn) in enumerate(stages):
            full = ops.gathered(handle, _tensors(x))
            if i < last:
                handle = ops.start_gather(stages[i + 1][0])
                xs.append(x)
                x = fn(full, x, batch)
                del full  # dead after the stage: the backward gathers it again
        loss, pull = _vjp(stages[-1][1], full, x, batch)
        del full
        if loss.ndim != 0:
            raise ValueError(f"the last stage's loss must be 0-d, got shape {tuple(loss.shape)}")
        cot = torch.ones_like(loss)
        ops.landed = [loss]
        grads: dict[str, torch.Tensor] = {}
        pending = None
        for i in range(last, -1, -1):
            names, fn = stages[i]
            if i < last:
                full = ops.gathered(handle, _tensors(cot))
                _, pull = _vjp(fn, full, xs[i], batch)
                del full
                xs[i] = None  # held by the pullback until it has run
            if i > 0:
                handle = ops.start_gather(stages[i - 1][0])
            g_full, cot = pull(cot)
            del pull
            reduce = ops.start_reduce(g_full, names)
            del g_full
            if pending is not None:  # the last stage's reduce traveled while this one ran
                _add(grads, ops.reduced(pending, last=False))
            pending = reduce
        _add(grads, ops.reduced(pending, last=True))
        return loss, {n: grads[n] for n in fn_plan.names}

    return run


def _add(grads: dict[str, torch.Tensor], reduced: dict[str, torch.Tensor]) -> None:
    for n, g in reduced.items():
        grads[n] = grads[n] + g if n in grads else g
