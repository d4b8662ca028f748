"""Z3 inside the compiled functional step: gather one stage's parameters at a time, free them
after its forward, gather them again for its backward.

    stages = [(names, fn), ...]    # fn(params, x, batch) -> x; the last stage returns the loss
    loss, grads = dmuon_fn.value_and_grad(stages, plan)(state.params, batch)

The differentiation is written out stage by stage with torch.func.vjp, so it needs neither
saved-tensor hooks (torch.func.grad rejects them in torch 2.13), nor checkpoint HOPs, nor a
custom autograd.Function (dynamo inlines its forward under torch.func.grad and drops the custom
backward). Forward: stage i's parameters are broadcast from their owners, fn runs, only its
input activation is kept. Backward, last stage first: broadcast again, recompute the stage under
vjp, pull the cotangent through, reduce the parameter gradients onto their owners. At any
moment a rank holds its own parameters and one stage's gathered copy (the last stage is
gathered once: its forward and backward are adjacent).

Collective order. Every gather and reduce is one dmuon op over one stage's parameters, and ranks'
graphs differ (owners and non-owners), so nothing may let a scheduler order them differently
per rank: each op takes a 0-size token made by the previous op (an extra entry with a size-1
route, so it never reaches torch.distributed) and makes the next — a strict data-dependency
chain G0 … G(L-1) R(L-1) G(L-2) R(L-2) … G0 R0, the same on every rank. A gather also waits
(`after`) for the activation it is needed for, so no scheduler can hoist it and hold two
stages' copies at once.

Overlap (prefetch=1, the default). Each gather and reduce is split into an asynchronous start
(dmuon::owner_broadcast_start, dmuon::two_stage_reduce_start), which returns a ticket, and
dmuon::collective_wait on that ticket. Stage i+1's gathers start before stage i computes and are
waited for after it (`after` = stage i's output); in backward, stage i-1's re-gathers start
before stage i is recomputed and differentiated, and stage i's reduce is waited for after stage
i-1's starts. Every start takes the previous start's ticket, so the starts form one chain
G0 G1 … G(L-1) G(L-2) R(L-1) G(L-3) R(L-2) … R0, the same on every rank, and every wait takes
the previous wait's results (HSDP's second reduce stage runs in the wait). At any moment a rank
holds its own parameters and two adjacent stages' gathered copies.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from ._plan import FnPlan

StageFn = Callable[[dict[str, torch.Tensor], Any, Any], Any]
Stage = tuple[Sequence[str], StageFn]

_SELF = (0, 1, 1, 0, 1, 1)  # a size-1 route: the token never reaches torch.distributed


def _flat(rows) -> list[int]:
    return [x for row in rows for x in row]


def check_stages(
    stages: Sequence[Stage], fn_plan: FnPlan
) -> tuple[tuple[tuple[str, ...], StageFn], ...]:
    """Each stage as (names, fn); every planned parameter in at least one stage."""
    if not stages:
        raise ValueError("stages is empty: pass [(names, fn), ...], the last returning the loss")
    out, seen = [], set()
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
        out.append((names, stage[1]))
    missing = [n for n in fn_plan.names if n not in seen]
    if missing:
        raise ValueError(f"{missing[0]!r} is in no stage: every planned parameter needs one")
    return tuple(out)


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _entries(rows, names, fn_plan, token):
    """One op's per-entry arguments over `names`, whose shapes are `rows`: (flattened shapes,
    ndims, flattened routes, extra inputs); a token adds a 0-size entry on a size-1 route."""
    routes = [fn_plan.route(n) for n in names]
    extra = []
    if token is not None:
        rows, routes, extra = [*rows, (0,)], [*routes, _SELF], [token]
    return _flat(rows), [len(s) for s in rows], _flat(routes), extra


def _by_name(names, outs, token):
    """(name -> the op's output, the next token: None without one)."""
    return dict(zip(names, outs[: len(names)], strict=True)), (None if token is None else outs[-1])


def _gather(params, names, fn_plan, token=None, after=None):
    """Parameters `names` in full on every rank of the shard group, in one op; with a token, the
    op also consumes it and returns the next one (None without)."""
    full = [fn_plan.shape(n) for n in names]
    shapes, ndims, routes, extra = _entries(full, names, fn_plan, token)
    outs = torch.ops.dmuon.owner_broadcast(
        [fn_plan.compute(params[n]) for n in names] + extra,
        shapes,
        ndims,
        routes,
        fn_plan.group,
        after=after,
    )
    return _by_name(names, outs, token)


def _reduce(grads, names, fn_plan, token=None):
    """Gradients of `names` -> the data-parallel mean on each global owner, zeros shaped like
    the local slot elsewhere, in one op; the token as in `_gather`."""
    local = [fn_plan.shape(n) if fn_plan.is_local_owner(n) else (0,) for n in names]
    shapes, ndims, routes, extra = _entries(local, names, fn_plan, token)
    outs = torch.ops.dmuon.two_stage_reduce(
        [fn_plan.summed(grads[n]) for n in names] + extra,
        shapes,
        ndims,
        routes,
        fn_plan.group,
        fn_plan.rep_group,
        1.0 / (fn_plan.shard_size * fn_plan.replicate_size),
    )
    return _by_name(names, outs, token)


def _vjp(fn: StageFn, full, x, batch):
    """(output, pullback): the pullback maps the output's cotangent to (param grads, x's)."""
    if x is None:
        out, pull = torch.func.vjp(lambda f: fn(f, None, batch), full)
        return out, lambda cot: (pull(cot)[0], None)
    return torch.func.vjp(lambda f, a: fn(f, a, batch), full, x)


def _last(fn: StageFn, full, x, batch):
    """The last stage under vjp: (its 0-d loss, the pullback, the loss's cotangent, 1)."""
    loss, pull = _vjp(fn, full, x, batch)
    if loss.ndim != 0:
        raise ValueError(f"the last stage must return a 0-d loss, got shape {tuple(loss.shape)}")
    return loss, pull, torch.ones_like(loss)


def _start_gather(params, names, fn_plan, after):
    """Stage `names`' gathers, issued: their ticket."""
    full = [fn_plan.shape(n) for n in names]
    shapes, ndims, routes, _ = _entries(full, names, fn_plan, None)
    locals_ = [fn_plan.compute(params[n]) for n in names]
    return torch.ops.dmuon.owner_broadcast_start(
        locals_, shapes, ndims, routes, fn_plan.group, after=after
    )


def _start_reduce(grads, names, fn_plan, after):
    """Stage `names`' gradient reduces, issued: their ticket."""
    local = [fn_plan.shape(n) if fn_plan.is_local_owner(n) else (0,) for n in names]
    shapes, ndims, routes, _ = _entries(local, names, fn_plan, None)
    return torch.ops.dmuon.two_stage_reduce_start(
        [fn_plan.summed(grads[n]) for n in names],
        shapes,
        ndims,
        routes,
        fn_plan.group,
        fn_plan.rep_group,
        1.0 / (fn_plan.shard_size * fn_plan.replicate_size),
        after=after,
    )


def _wait(ticket, like, rows, names, after):
    """The results behind `ticket` by name; `like[n]` has output n's dtype and device."""
    shapes, ndims = _flat(rows), [len(r) for r in rows]
    outs = torch.ops.dmuon.collective_wait(
        ticket, [like[n] for n in names], shapes, ndims, after=after
    )
    return dict(zip(names, outs, strict=True))


def _empty_like(tensors: dict[str, torch.Tensor], names, cast) -> dict[str, torch.Tensor]:
    """0-size tensors in the dtype `cast` gives each of `tensors` (what a collective sends)."""
    return {n: cast(tensors[n].new_empty(0)) for n in names}


def staged_value_and_grad(stages: Sequence[Stage], fn_plan: FnPlan, prefetch: int = 1):
    """(params, batch) -> (this rank's loss, grads), as value_and_grad, holding one stage's
    gathered parameters at a time (two adjacent ones with prefetch=1, whose collectives then
    overlap the stages' computation). A name may appear in several stages (tied weights): its
    gradient is reduced after each and summed on the owner."""
    stages = check_stages(stages, fn_plan)
    if prefetch not in (0, 1):
        raise ValueError(f"prefetch must be 0 or 1 (one stage ahead), got {prefetch!r}")
    if prefetch:
        return _overlapped(stages, fn_plan)

    def run(params: dict[str, torch.Tensor], batch: Any):
        token = params[fn_plan.names[0]].new_zeros(0)
        xs, x = [], None
        for names, fn in stages[:-1]:
            full, token = _gather(params, names, fn_plan, token, _tensors(x))
            xs.append(x)
            x = fn(full, x, batch)
            del full  # dead after the stage: the backward gathers it again
        names, fn = stages[-1]
        full, token = _gather(params, names, fn_plan, token, _tensors(x))
        loss, pull, cot = _last(fn, full, x, batch)
        del full
        grads: dict[str, torch.Tensor] = {}
        for i in range(len(stages) - 1, -1, -1):
            names, fn = stages[i]
            if i < len(stages) - 1:
                full, token = _gather(params, names, fn_plan, token, _tensors(cot))
                _, pull = _vjp(fn, full, xs[i], batch)
                del full
                xs[i] = None  # held by the pullback until it has run
            g_full, cot = pull(cot)
            del pull
            reduced, token = _reduce(g_full, names, fn_plan, token)
            for n, g in reduced.items():
                grads[n] = grads[n] + g if n in grads else g
        return loss, {n: grads[n] for n in fn_plan.names}

    return run


def _overlapped(stages, fn_plan: FnPlan):
    """The staged step with each stage's collectives started one stage ahead (module
    docstring, "Overlap")."""

    def run(params: dict[str, torch.Tensor], batch: Any):
        full_shapes = {n: [fn_plan.shape(n)] for names, _ in stages for n in names}
        p_like = _empty_like(params, full_shapes, fn_plan.compute)

        def gather_wait(ticket, names, after):
            return _wait(ticket, p_like, [full_shapes[n][0] for n in names], names, after)

        names0 = stages[0][0]
        chain = _start_gather(params, names0, fn_plan, [params[fn_plan.names[0]].new_zeros(0)])
        full = gather_wait(chain, names0, None)
        xs, x = [], None
        for i in range(len(stages) - 1):
            chain = nxt = _start_gather(params, stages[i + 1][0], fn_plan, [chain])
            xs.append(x)
            x = stages[i][1](full, x, batch)
            del full  # dead after the stage: the backward gathers it again
            full = gather_wait(nxt, stages[i + 1][0], _tensors(x))
        names, fn = stages[-1]
        loss, pull, cot = _last(fn, full, x, batch)
        del full
        grads: dict[str, torch.Tensor] = {}
        regather, pending, landed = None, None, [loss]
        for i in range(len(stages) - 1, -1, -1):
            names, fn = stages[i]
            if i < len(stages) - 1:
                full = gather_wait(regather, names, _tensors(cot))
                _, pull = _vjp(fn, full, xs[i], batch)
                del full
                xs[i] = None  # held by the pullback until it has run
            if i > 0:
                chain = regather = _start_gather(params, stages[i - 1][0], fn_plan, [chain])
            g_full, cot = pull(cot)
            del pull
            chain = _start_reduce(g_full, names, fn_plan, [chain])
            like = _empty_like(g_full, names, fn_plan.summed)
            del g_full
            if pending is not None:  # the last stage's reduce traveled while this one ran
                landed = _land(pending, grads, fn_plan, [chain, *landed])
            pending = (chain, names, like)
        _land(pending, grads, fn_plan, landed)
        return loss, {n: grads[n] for n in fn_plan.names}

    return run


def _land(pending, grads, fn_plan, after) -> list[torch.Tensor]:
    """Wait for a stage's reduce and add its results to `grads`; returns them (the next wait
    waits for them)."""
    ticket, names, like = pending
    rows = [fn_plan.shape(n) if fn_plan.is_local_owner(n) else (0,) for n in names]
    reduced = _wait(ticket, like, rows, names, after)
    for n, g in reduced.items():
        grads[n] = grads[n] + g if n in grads else g
    return list(reduced.values())
