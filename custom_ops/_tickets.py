"""Tickets: what an asynchronous collective op hands to the op that waits for it.

A start op (dmuon::owner_broadcast_start, dmuon::two_stage_reduce_start) issues its collectives
and returns a ticket, a one-element int64 CPU tensor whose value keys the collectives' `finish`
here; dmuon::collective_wait redeems it for the results. Being a tensor, the ticket makes the
wait depend on the start in any graph, and start ops take the previous ticket in `after`, so
one chain of tickets orders every collective of a step the same way on every rank.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch
from torch import Tensor

_PENDING: dict[int, tuple[Callable[[], list[Tensor]], bool]] = {}
_NEXT = itertools.count(1)


def issue(finish: Callable[[], list[Tensor]], *, once: bool = True) -> Tensor:
    """Register `finish` (waits for the collectives, returns the results); return the ticket.
    once=False: redeemable again and again (the contract test's samples, which run an op
    several times on the same arguments; `finish` must then be repeatable)."""
    key = next(_NEXT)
    _PENDING[key] = (finish, once)
    with torch.profiler.record_function("dmuon::ticket"):  # its own label: not a gathered copy
        return torch.tensor([key], dtype=torch.int64, device="cpu")


def redeem(ticket: Tensor) -> list[Tensor]:
    """The results of the collectives behind `ticket` (waits for them; once per ticket)."""
    key = int(ticket.item())
    if key not in _PENDING:
        raise RuntimeError(f"dmuon: ticket {key} was already redeemed or never issued")
    finish, once = _PENDING[key]
    if once:
        del _PENDING[key]
    return finish()


def fake_ticket() -> Tensor:
    return torch.empty(1, dtype=torch.int64, device="cpu")
