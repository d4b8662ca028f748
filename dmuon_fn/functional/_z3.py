"""Z3 inside the compiled functional step: each stage's parameters gathered for its forward, freed,
and gathered again for its backward (torch.func.vjp stage by stage); each gather and reduce one
dmuon op over one stage, in one order on every rank (proofs/step_notes.md)."""

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


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _entries(values, rows, names, fn_plan, token):
    """(values, flat shapes, ndims, flat routes) of an op over `names` shaped `rows`; a token
    adds a 0-size entry on a size-1 route."""
    routes = [fn_plan.route(n) for n in names]
    if token is not None:
        values, rows, routes = [*values, token], [*rows, (0,)], [*routes, _SELF]
    return values, _flat(rows), [len(s) for s in rows], _flat(routes)


def _local_rows(names, fn_plan) -> list[tuple[int, ...]]:
    """Each reduced gradient's shape here: the parameter's on a local owner, else (0,)."""
    return [fn_plan.shape(n) if fn_plan.is_local_owner(n) else (0,) for n in names]


def _by_name(names, outs, token):
    """(name -> the op's output, the next token: None without one)."""
    return dict(zip(names, outs[: len(names)], strict=True)), (None if token is None else outs[-1])


def _gather(params, names, fn_plan, token=None, after=None, start=False):
    """Parameters `names` in full on every shard rank, in one op: ({name: full}, next token or
    None); start: only issue it and return its ticket (for dmuon::collective_wait)."""
    values = [fn_plan.compute(params[n]) for n in names]
    args = _entries(values, [fn_plan.shape(n) for n in names], names, fn_plan, token)
    op = torch.ops.dmuon.owner_broadcast_start if start else torch.ops.dmuon.owner_broadcast
    outs = op(*args, fn_plan.group, after=after)
    return outs if start else _by_name(names, outs, token)


def _reduce(grads, names, fn_plan, token=None, after=None, start=False):
    """Gradients of `names` -> the data-parallel mean on each global owner, zeros shaped like
    the local slot elsewhere, in one op; token and start as `_gather`'s."""
    values = [fn_plan.summed(grads[n]) for n in names]
    args = (
        *_entries(values, _local_rows(names, fn_plan), names, fn_plan, token),
        fn_plan.group,
        fn_plan.rep_group,
        1.0 / (fn_plan.shard_size * fn_plan.replicate_size),
    )
    if start:
        return torch.ops.dmuon.two_stage_reduce_start(*args, after=after)
    return _by_name(names, torch.ops.dmuon.two_stage_reduce(*args), token)


def _vjp(fn: StageFn, full, x, batch):
    """(output, pullback): the pullback maps the output's cotangent to (param grads, x's)."""
    if x is None:
        out, pull = torch.func.vjp(lambda f: fn(f, None, batch), full)
        return out, lambda cot: (pull(cot)[0], None)
    return torch.func.vjp(lambda f, a: fn(f, a, batch), full, x)


class _Blocking:
    """prefetch=0: each gather and reduce one blocking op where its result is needed, ordered by
    a token chain. `start_*` return handles, `gathered` / `reduced` their results."""

    def __init__(self, params, fn_plan: FnPlan) -> None:
        self.params, self.plan = params, fn_plan
        self.token = params[fn_plan.names[0]].new_zeros(0)

    def start_gather(self, names):
        return names  # issued by `gathered`, where the result is needed

    def gathered(self, names, after):
        full, self.token = _gather(self.params, names, self.plan, self.token, after)
        return full

    def start_reduce(self, g_full, names):
        reduced, self.token = _reduce(g_full, names, self.plan, self.token)
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
        self.chain = _gather(self.params, names, self.plan, after=[self.chain], start=True)
        return self.chain, names

    def gathered(self, handle, after):
        ticket, names = handle
        likes = [self.like[n] for n in names]
        return self._wait(ticket, likes, [self.plan.shape(n) for n in names], names, after)

    def start_reduce(self, g_full, names):
        self.chain = _reduce(g_full, names, self.plan, after=[self.chain], start=True)
        return self.chain, names, [self.plan.summed(g_full[n].new_empty(0)) for n in names]

    def reduced(self, handle, last: bool):
        ticket, names, likes = handle
        after = self.landed if last else [self.chain, *self.landed]
        out = self._wait(ticket, likes, _local_rows(names, self.plan), names, after)
        self.landed = list(out.values())
        return out

    @staticmethod
    def _wait(ticket, likes, rows, names, after):
        """The results behind `ticket` by name; `likes[i]` has output i's dtype and device."""
        ndims = [len(r) for r in rows]
        outs = torch.ops.dmuon.collective_wait(ticket, likes, _flat(rows), ndims, after=after)
        return dict(zip(names, outs, strict=True))


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
            raise ValueError(
                f"the last stage must return a 0-d loss, got shape {tuple(loss.shape)}"
            )
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
