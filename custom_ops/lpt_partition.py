"""dmuon::lpt_partition — owner slot of each scheduling unit, by the planner's algorithm.

costs: (n,) real, finite, >= 0 (FLOPs per unit); world_size: S slots; groups: (n,) int64 layer ids,
-1: none; nbytes: (n,) real bytes; replicate_size: R dividing S. Returns (n,) int64 slots in [0, S)
on costs' device, from `custom_ops._lpt.schedule` on the host. No autograd."""

from __future__ import annotations

import torch
from torch import Tensor

from ._lpt import SPREAD_TOLERANCE, schedule
from ._registry import OpSpec, check_like, register_op


def _check(costs: Tensor, groups: Tensor | None, nbytes: Tensor | None) -> None:
    if costs.dim() != 1 or costs.dtype.is_complex or costs.dtype == torch.bool:
        got = f"{tuple(costs.shape)} {costs.dtype}"
        raise ValueError(f"lpt_partition: costs must be a 1-D real tensor, got {got}")
    check_like("lpt_partition", "groups", groups, costs.shape, torch.int64)
    check_like("lpt_partition", "nbytes", nbytes, costs.shape)


@torch.library.custom_op("dmuon::lpt_partition", mutates_args=())
def lpt_partition(
    costs: Tensor,
    world_size: int,
    groups: Tensor | None = None,
    nbytes: Tensor | None = None,
    replicate_size: int = 1,
    refine: bool = True,
    spread_tolerance: float = SPREAD_TOLERANCE,
) -> Tensor:
    _check(costs, groups, nbytes)
    owners = schedule(
        costs.tolist(),
        world_size,
        groups=None if groups is None else groups.tolist(),
        nbytes=None if nbytes is None else nbytes.tolist(),
        replicate=replicate_size,
        refined=refine,
        spread_tolerance=spread_tolerance,
    )
    return torch.tensor(owners, dtype=torch.int64, device=costs.device)


@lpt_partition.register_fake
def _(costs, world_size, groups=None, nbytes=None, *options):
    _check(costs, groups, nbytes)
    return costs.new_empty(costs.shape, dtype=torch.int64)


def _samples():
    g = torch.Generator().manual_seed(3)
    costs = torch.rand(40, generator=g, dtype=torch.float64) * 1e12
    yield (costs, 8), {}
    yield (costs, 3), {"refine": False}
    layers = torch.arange(40, dtype=torch.int64) // 7  # 7 units per layer, as a Llama block
    yield (costs.float(), 8), {"groups": layers, "nbytes": costs.sqrt()}
    yield (costs, 16), {"groups": layers, "nbytes": costs.sqrt(), "replicate_size": 4}
    yield (torch.tensor([3.0, 3.0, 2.0, 2.0, 2.0]), 2), {}  # Graham's tight case: 7 -> 6


register_op(OpSpec("dmuon::lpt_partition", torch.ops.dmuon.lpt_partition, _samples, False))
