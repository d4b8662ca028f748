"""The functional API's plan for one rank: who owns what, as plain hashable data (a compile-time
constant of the step), below both the step (`_functional.py`) and its Z3 stages
(`_functional_z3.py`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..planning._partition import Plan
from ..planning._summary import PlanSummary, plan_summary
from ..planning._view import RankView, Route


@dataclass(frozen=True)
class FnPlan:
    """Who owns what, for this rank: plain data, hashable, a compile-time constant."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    muon: frozenset[str]
    trainable: frozenset[str]  # requires_grad at plan time; `update` leaves the rest as they are
    view: RankView  # the job's plan, seen from this rank
    group: str
    rep_group: str
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

    @property
    def partition(self) -> Plan:
        return self.view.plan

    @property
    def shard_size(self) -> int:
        return self.view.plan.shard_size

    @property
    def replicate_size(self) -> int:
        return self.view.plan.replicate_size

    def route(self, name: str) -> Route:
        return self.view.route(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.shapes[self.names.index(name)]

    def is_local_owner(self, name: str) -> bool:
        return self.view.is_local_owner(name)

    def is_global_owner(self, name: str) -> bool:
        return self.view.is_global_owner(name)
