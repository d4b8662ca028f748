"""Tickets: what an asynchronous collective op (dmuon::*_start) hands to dmuon::collective_wait.

A ticket is a (1,) int64 CPU tensor whose value keys the collectives' `finish`; redeeming it waits
for them and returns the results. As a tensor it orders the wait after the start in any graph
(proofs/custom_ops_notes.md, "Tickets").
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
    once=False: redeemable again and again (`finish` must then be repeatable)."""
    key = next(_NEXT)
    _PENDING[key] = (finish, once)
    with torch.profiler.record_function("dmuon::ticket"):  # its own label: not a gathered copy
        return torch.tensor([key], dtype=torch.int64, device="cpu")


def redeem(ticket: Tensor) -> list[Tensor]:
    """The results of the collectives behind `ticket` (waits for them)."""
    key = int(ticket.item())
    if key not in _PENDING:
        raise RuntimeError(f"dmuon: ticket {key} was already redeemed or never issued")
    finish, once = _PENDING[key]
    if once:
        del _PENDING[key]
    return finish()


def fake_ticket() -> Tensor:
    return torch.empty(1, dtype=torch.int64, device="cpu")
