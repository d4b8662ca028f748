"""The functional step's guards under torch.compile(fullgraph=True): global-norm
clipping equal to torch.nn.utils.clip_grad_norm_ on a one-process reference, and a non-finite
gradient on one rank leaving every parameter and optimizer state bitwise unchanged everywhere,
with no recompile (the decision is a tensor); and a rank with another NS kernel is an error at
init."""

from __future__ import annotations

import os

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import dmuon_fn as dmuon
from tests._dist import run_ranks
from tests._models import HP, batch, config_fp32, make, meshes

FROZEN = "layers.0.up_proj.weight"


def _setup(rank, world, hsdp, frozen=False, **cfg):
    mesh, rep = meshes(world, hsdp)
    model = make("mlp")
    model.get_parameter(FROZEN).requires_grad_(not frozen)
    fp = dmuon.plan(model, mesh, replicate_mesh=rep)
    state = dmuon.init(model, fp, config_fp32(**cfg))

    def loss_fn(params, x):
        return torch.func.functional_call(model, params, (x,))

    def step(state, x, lr):
        _, grads = dmuon.value_and_grad(loss_fn, fp)(state.params, x)
        return dmuon.global_grad_norm(grads, fp), dmuon.update(grads, state, lr=lr)

    torch._dynamo.reset()
    cnt = CompileCounterWithBackend("aot_eager")
    return state, torch.compile(step, backend=cnt, fullgraph=True), cnt


def _norm(rank, world, hsdp, frozen):
    state, step, cnt = _setup(rank, world, hsdp, frozen, max_grad_norm=0.05)
    norm, _ = step(state, batch("mlp", 0, rank), torch.tensor(HP["lr"]))
    return norm.item(), cnt.frame_count


@pytest.mark.parametrize(
    "world,hsdp,frozen",
    [
        (1, False, False),
        (2, False, False),
        (2, False, True),
        pytest.param(4, True, False, marks=pytest.mark.slow),
    ],
)
def test_global_grad_norm_equals_torch_on_the_unsharded_model(world, hsdp, frozen):
    """Over the trainable parameters: a frozen one is left out, as torch leaves out a
    parameter without .grad."""
    ref = make("mlp")
    ref.get_parameter(FROZEN).requires_grad_(not frozen)
    (sum(ref(batch("mlp", 0, r)) for r in range(world)) / world).backward()
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), float("inf")).item()
    assert want > 0.05  # so the clipping test below clips
    for norm, frames in run_ranks(_norm, world, hsdp, frozen):
        assert abs(norm - want) / want < 1e-5 and frames == 1


def _scaled_reference(rank, world, hsdp):
    """Clipping == multiplying the loss by the clip coefficient (gradients are linear in it)."""
    state, step, _ = _setup(rank, world, hsdp, max_grad_norm=0.05)
    _, a = step(state, batch("mlp", 0, rank), torch.tensor(HP["lr"]))
    state, step, _ = _setup(rank, world, hsdp)
    norm, _ = step(state, batch("mlp", 0, rank), torch.tensor(0.0))
    coef = 0.05 / (norm.float() + 1e-6)

    mesh, rep = meshes(world, hsdp)
    model = make("mlp")
    fp = dmuon.plan(model, mesh, replicate_mesh=rep)
    state = dmuon.init(model, fp, config_fp32())

    def scaled(params, x):
        return torch.func.functional_call(model, params, (x,)) * coef

    _, grads = dmuon.value_and_grad(scaled, fp)(state.params, batch("mlp", 0, rank))
    b = dmuon.update(grads, state, lr=torch.tensor(HP["lr"]))
    pa, pb = dmuon.full_params(a), dmuon.full_params(b)
    return max(((pa[n] - pb[n]).norm() / pb[n].norm()).item() for n in pa)


@pytest.mark.parametrize("world,hsdp", [(2, False), pytest.param(4, True, marks=pytest.mark.slow)])
def test_clipping_scales_every_gradient_by_max_norm_over_the_global_norm(world, hsdp):
    assert max(run_ranks(_scaled_reference, world, hsdp)) < 1e-5


def _nonfinite(rank, world, hsdp):
    state, step, cnt = _setup(rank, world, hsdp)
    for s in range(2):
        _, state = step(state, batch("mlp", s, rank), torch.tensor(HP["lr"]))
    before = state
    x = batch("mlp", 2, rank)
    if rank == world - 1:
        x[0, 0] = float("nan")  # one sample on one rank
    norm, after = step(state, x, torch.tensor(HP["lr"] / 2))
    same = all(torch.equal(before.params[n], after.params[n]) for n in before.params) and all(
        torch.equal(a, b)
        for n in before.opt
        for a, b in zip(before.opt[n], after.opt[n], strict=True)
    )
    _, moved = step(after, batch("mlp", 3, rank), torch.tensor(HP["lr"]))
    changed = any(not torch.equal(after.params[n], moved.params[n]) for n in after.params)
    owns = any(t.numel() for t in after.params.values())
    return same, changed or not owns, norm.isnan().item(), cnt.frame_count


@pytest.mark.parametrize(
    "world,hsdp", [(1, False), (2, False), pytest.param(4, True, marks=pytest.mark.slow)]
)
def test_nonfinite_gradient_skips_the_compiled_step_everywhere(world, hsdp):
    for same, changed, nan, frames in run_ranks(_nonfinite, world, hsdp):
        assert same and changed and nan and frames == 1


def _mismatch(rank, world):
    if rank == 1:
        os.environ["DMUON_NS_KERNEL"] = "torch_mm"  # this rank only
    mesh, _ = meshes(world, False)
    model = make("mlp")
    try:
        dmuon.init(model, dmuon.plan(model, mesh))
    except dmuon.PlanMismatchError as e:
        return str(e)
    return "no error"


def test_a_rank_with_another_kernel_is_detected_at_init():
    for msg in run_ranks(_mismatch, 2):
        assert "ranks 0 and 1 disagree on NS kernel: 'cpu_syrk' on rank 0, 'torch_mm'" in msg


def test_config_validates_the_guard():
    with pytest.raises(ValueError, match="max_grad_norm must be > 0"):
        dmuon.Config(max_grad_norm=0.0)
    with pytest.raises(ValueError, match="cannot raise without a host sync"):
        dmuon.Config(nonfinite="raise")


def test_config_validates_the_hyperparameters():
    for field, bad in (("lr", -0.1), ("adamw_lr", float("nan")), ("momentum", -1.0)):
        with pytest.raises(ValueError, match=rf"Config\.{field} must be >= 0"):
            dmuon.Config(**{field: bad})
    with pytest.raises(ValueError, match=r"adamw_betas must lie in \[0, 1\)"):
        dmuon.Config(adamw_betas=(0.9, 1.0))
    assert dmuon.Config(adamw_lr=None).adamw_lr is None  # None: update uses lr
