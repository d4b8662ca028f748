"""What trainers set around FSDP2, on a dedicated model (torchtitan sets both): FSDP2's
gradient divide factor, which the dedicated gradients follow module by module, and selective
activation checkpointing (torch.utils.checkpoint with a policy), whose recompute the library's
hooks stay out of. Each against the same model without the knob, 2 gloo ranks."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

import dmuon_fn as dmuon
from tests._dist import run_ranks
from tests._models import Block, D, full_params, is_proj, meshes, muon_fp32

STEPS = 2


class _Stack(nn.Module):
    """Two transformer blocks and a head: the blocks are what activation checkpointing wraps."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(D, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x).square().mean()


def _x(step: int, rank: int) -> torch.Tensor:
    return torch.randn(2, 8, D, generator=torch.Generator().manual_seed(100 * step + rank))


def _save_mm(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """torchtitan's selective policy in small: keep matmul outputs, recompute the rest."""
    if op is torch.ops.aten.mm.default:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _train(rank: int, world: int, ac: str, divide: float | None) -> dict:
    """dedicate_params, then activation checkpointing on each block (`ac`: none, full,
    selective), then fully_shard per block and root (torchtitan's order); `divide`: FSDP2's
    gradient divide factor on every module (the loss scaled by 1 / divide · world to match)."""
    torch.manual_seed(7)
    model = _Stack()
    mesh, _ = meshes(world, hsdp=False)
    dmuon.dedicate_params(model, mesh, is_proj)
    for i, block in enumerate(model.layers):
        if ac == "full":
            model.layers[i] = checkpoint_wrapper(block)
        elif ac == "selective":
            sac = functools.partial(create_selective_checkpoint_contexts, _save_mm)
            model.layers[i] = checkpoint_wrapper(block, context_fn=sac)
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if divide is not None:
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_gradient_divide_factor(divide)
                m.set_force_sum_reduction_for_comms(True)  # (gloo has no PREMUL_SUM)
    opt = muon_fp32(model)
    losses, grads = [], []
    for step in range(STEPS):
        opt.zero_grad()
        loss = model(_x(step, rank))
        scale = 1.0 if divide is None else divide / world  # the same mean gradient
        (loss * scale).backward()
        grads.append(full_params(model, get=lambda p: p.grad))
        opt.step()
        losses.append(loss.item())
    return dict(losses=losses, grads=[_plain(x) for x in grads], params=_plain(full_params(model)))


def _plain(values: dict) -> dict:
    """`values` by the plain model's names (activation checkpointing's wrapper left out)."""
    return {n.replace("._checkpoint_wrapped_module", ""): v for n, v in values.items()}


def _all(rank: int, world: int) -> dict:
    cases = {"base": ("none", None), "sum": ("none", 1.0), "full": ("full", None)}
    cases["selective"] = ("selective", None)
    return {k: _train(rank, world, *v) for k, v in cases.items()}


@pytest.fixture(scope="module")
def runs():
    return run_ranks(_all, 2)


@pytest.mark.parametrize("case", ["sum", "full", "selective"])
def test_knob_trains_as_without_it(runs, case):
    """`sum`: divide factor 1 (torchtitan's) with the loss divided by the world: every gradient,
    dedicated and sharded, equals the mean one (an exact power of two), so the run is the base's
    bit for bit; `full` / `selective` activation checkpointing: the recompute gives the same
    gradients as keeping the activations."""
    for rank, r in enumerate(runs):
        base, got = r["base"], r[case]
        assert got["losses"] == base["losses"], (case, rank)
        for step in range(STEPS):
            for n, want in base["grads"][step].items():
                assert torch.equal(got["grads"][step][n], want), (case, rank, step, n)
        for n, want in base["params"].items():
            assert torch.equal(got["params"][n], want), (case, rank, n)
