"""The functional API's plan for one rank: who owns what, as plain hashable data (a compile-time
constant of the step), below both the step (`_functional.py`) and its Z3 stages
(`_functional_z3.py`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..planning._partition import Plan
from ..planning._summary import PlanSummary, plan_summary

Route = tuple[int, int, int, int, int, int]


@dataclass(frozen=True)
class FnPlan:
    """Who owns what, for this rank: plain data, hashable, a compile-time constant."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    muon: frozenset[str]
    trainable: frozenset[str]  # requires_grad at plan time; `update` leaves the rest as they are
    routes: tuple[Route, ...]  # per name: (src, is_src, G, rep_src, is_rep_src, R)
    group: str
    rep_group: str
    shard_size: int
    replicate_size: int
    partition: Plan
    # mixed precision (None: the model dtype throughout, no separate master)
    param_dtype: torch.dtype | None = None  # what is gathered and computed with
    reduce_dtype: torch.dtype | None = None  # what gradients are summed in (None: param_dtype)

    def compute(self, t: torch.Tensor) -> torch.Tensor:
        """`t` (a held value, master or placeholder) as it is gathered: in `param_dtype`."""
        return t if self.param_dtype is None else t.to(self.param_dtype)

    def summed(self, g: torch.Tensor) -> torch.Tensor:
        """A gradient `g` as it is reduced: in `reduce_dtype` (default `param_dtype`)."""
        dt = self.reduce_dtype or self.param_dtype
        return g if dt is None else g.to(dt)

    def summary(self, gemm_flops: float | None = None) -> PlanSummary:
        """Who owns what and each rank's Newton-Schulz share, as a table (`str`) and as data
        (`.as_dict()`); with gemm_flops (FLOP/s) the busiest rank's seconds per step."""
        return plan_summary(self.partition, gemm_flops=gemm_flops)

    def __str__(self) -> str:
        return str(self.summary())

    def route(self, name: str) -> Route:
        return self.routes[self.names.index(name)]

    def shape(self, name: str) -> tuple[int, ...]:
        return self.shapes[self.names.index(name)]

    def is_local_owner(self, name: str) -> bool:
        return bool(self.route(name)[1])

    def is_global_owner(self, name: str) -> bool:
        r = self.route(name)
        return bool(r[1] and r[4])
