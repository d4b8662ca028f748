"""The functional face's collectives: a gather of parameters or a reduce of gradients is one
owner op over the shard group, an entry per piece (a parameter not sliced is its one piece), the
pieces of a sliced parameter joined after a gather (`join`) (proofs/step_notes.md)."""

from __future__ import annotations

import torch

from ..planning._slices import join, take

_SELF = (0, 1, 1, 0, 1, 1)  # a size-1 route: the token never reaches torch.distributed


def flat(rows) -> list[int]:
    return [x for row in rows for x in row]


def owner_entries(values, rows, routes, token=None):
    """(values, flat shapes, ndims, flat routes) of an owner op; a token joins on a size-1 route."""
    if token is not None:
        values, rows, routes = [*values, token], [*rows, (0,)], [*routes, _SELF]
    return values, flat(rows), [len(s) for s in rows], flat(routes)


def full_rows(pieces, fn_plan) -> list[tuple[int, ...]]:
    """Each piece's shape (a parameter not sliced: its own)."""
    return [fn_plan.partition.shape(p) for _, p in pieces]


def local_rows(pieces, fn_plan) -> list[tuple[int, ...]]:
    """Each piece's reduced gradient's shape here: the piece's on its local owner, else (0,)."""
    rows = full_rows(pieces, fn_plan)
    held = [fn_plan.view.is_local_owner(p) for _, p in pieces]
    return [r if h else (0,) for r, h in zip(rows, held, strict=True)]


def joined(pieces, outs, fn_plan, gathered: bool) -> dict[str, torch.Tensor]:
    """Per parameter, from its pieces' outputs (a token after them ignored): gathered, their
    `join`; reduced, the one this rank holds (else the first, 0-size)."""
    by: dict[str, list[tuple[str, torch.Tensor]]] = {}
    for (n, p), out in zip(pieces, outs[: len(pieces)], strict=True):
        by.setdefault(n, []).append((p, out))
    if gathered:
        return {n: join(*zip(*v, strict=True)) for n, v in by.items()}
    held = fn_plan.view.is_local_owner
    return {n: next((o for p, o in v if held(p)), v[0][1]) for n, v in by.items()}


def _by_name(pieces, outs, fn_plan, token, gathered: bool):
    """(name -> its output, the next token: None without one)."""
    return joined(pieces, outs, fn_plan, gathered), (None if token is None else outs[-1])


def gather_params(params, names, fn_plan, token=None, after=None, start=False):
    """Parameters `names` in full on every shard rank, in one op (a piece per owner entry):
    ({name: full}, next token or None); start: only issue it and return its ticket (for
    dmuon::collective_wait)."""
    pieces = fn_plan.pieces(names)
    values = [  # what this rank holds of each piece (0-size: none of it; a whole parameter's
        # holder passes its value, any other rank its 0-size placeholder: the same graph)
        fn_plan.compute(params[n] if p == n or fn_plan.view.is_local_owner(p) else params[n][:0])
        for n, p in pieces
    ]
    routes = [fn_plan.route(p) for _, p in pieces]
    args = owner_entries(values, full_rows(pieces, fn_plan), routes, token)
    op = torch.ops.dmuon.owner_broadcast_start if start else torch.ops.dmuon.owner_broadcast
    outs = op(*args, fn_plan.group, after=after)
    return outs if start else _by_name(pieces, outs, fn_plan, token, gathered=True)


def reduce_grads(grads, names, fn_plan, token=None, after=None, start=False):
    """Gradients of `names` -> the data-parallel mean on each global owner (of each piece),
    zeros shaped like the local slot elsewhere, in one op; token and start as `gather_params`'s."""
    pieces = fn_plan.pieces(names)
    values = [fn_plan.summed(take(grads[n], p) if p != n else grads[n]) for n, p in pieces]
    routes = [fn_plan.route(p) for _, p in pieces]
    entries = owner_entries(values, local_rows(pieces, fn_plan), routes, token)
    scale = 1.0 / (fn_plan.shard_size * fn_plan.replicate_size)
    args = (*entries, fn_plan.group, fn_plan.rep_group, scale)
    if start:
        return torch.ops.dmuon.two_stage_reduce_start(*args, after=after)
    outs = torch.ops.dmuon.two_stage_reduce(*args)
    return _by_name(pieces, outs, fn_plan, token, gathered=False)
