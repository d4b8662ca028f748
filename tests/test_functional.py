"""The functional API: a whole distributed step under torch.compile(fullgraph=True).

World sizes 1, 2, 4 and a 2×2 HSDP mesh: zero graph breaks, one compiled graph across 5 steps
whose lr / weight decay change (no recompiles), compiled == eager functional == the object API
(dedicate_params(pure=True) + Muon) == a plain single-process reference, to fp32 rounding
(Newton-Schulz iterates in fp32 here; see tests/test_distributed.py for the tolerance).
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters
from torch.distributed.device_mesh import init_device_mesh

import dmuon_fn as dmuon
from tests._dist import run_ranks
from tests._models import HP, batch, config_fp32, make, meshes, muon_fp32, reference

STEPS = 5
TOL = 5e-5
CFG = config_fp32()


def _functional(rank, world, name, hsdp, compiled):
    mesh, rep = meshes(world, hsdp)
    model = make(name)
    fp = dmuon.plan(model, mesh, replicate_mesh=rep)
    state = dmuon.init(model, fp, CFG)

    def loss_fn(params, x):
        return torch.func.functional_call(model, params, (x,))

    def train_step(state, x, lr, alr):
        loss, grads = dmuon.value_and_grad(loss_fn, fp)(state.params, x)
        return loss, dmuon.update(grads, state, lr=lr, adamw_lr=alr)

    cnt = CompileCounterWithBackend("aot_eager")  # AOTAutograd: fakes, functionalization
    if compiled:
        torch._dynamo.reset()
        counters.clear()
        train_step = torch.compile(train_step, backend=cnt, fullgraph=True)
    for step in range(STEPS):
        decay = 1.0 / (step + 1)  # a schedule: new lr values every step
        _, state = train_step(
            state,
            batch(name, step, rank),
            torch.tensor(HP["lr"] * decay),
            torch.tensor(HP["adamw_lr"] * decay),
        )
    return dict(
        params=dmuon.full_params(state),
        frames=cnt.frame_count,
        breaks=sum(counters["graph_break"].values()) if compiled else 0,
    )


def _object_api(rank, world, name):
    mesh, _ = meshes(world, False)
    if mesh is None:
        mesh = init_device_mesh("cpu", (1,))
    model = make(name)
    dmuon.dedicate_params(model, mesh, pure=True)
    opt = muon_fp32(model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    for step in range(STEPS):
        opt.zero_grad()
        model(batch(name, step, rank)).backward()
        opt.step()
        sched.step()
    st = model._dmuon_state
    out = {}
    for n, p in model.named_parameters():
        e = st.entry(p)
        buf = e.param.detach().clone() if st.is_global_owner(e) else torch.empty(e.shape)
        if world > 1:
            torch.distributed.broadcast(buf, src=e.owner_shard)
        out[n] = buf
    return out


def _all(rank, world, cases):
    out = []
    for name, hsdp in cases:
        out.append(
            dict(
                eager=_functional(rank, world, name, hsdp, False),
                compiled=_functional(rank, world, name, hsdp, True),
                obj=_object_api(rank, world, name) if not hsdp else None,
            )
        )
    return out


def _rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _check(world, cases, results):
    for i, (name, hsdp) in enumerate(cases):
        muon = {n for n, p in make(name).named_parameters() if p.ndim >= 2}
        lr_sched = dict(HP)
        ref = _reference_with_schedule(name, world, muon, lr_sched)
        for r in results:
            res = r[i]
            assert res["compiled"]["frames"] == 1, "one graph, no recompiles"
            assert res["compiled"]["breaks"] == 0
            for n, want in ref.items():
                assert _rel(res["eager"]["params"][n], want) < TOL, (name, hsdp, n)
                assert _rel(res["compiled"]["params"][n], res["eager"]["params"][n]) < TOL
                if res["obj"] is not None:
                    assert _rel(res["obj"][n], res["eager"]["params"][n]) < TOL, n


def _reference_with_schedule(name, world, muon, hp):
    """tests._models.reference with lr and adamw_lr decayed as 1/(step+1)."""
    return reference(name, world, STEPS, muon, hp, schedule=lambda s: 1.0 / (s + 1))


CASES = [("mlp", False), ("transformer", False)]


def test_world_1():
    _check(1, CASES, run_ranks(_all, 1, CASES))


@pytest.mark.slow
def test_world_2():
    _check(2, CASES, run_ranks(_all, 2, CASES))


@pytest.mark.slow
def test_world_4_and_hsdp_2x2():
    cases = [*CASES, ("mlp", True), ("transformer", True)]
    _check(4, cases, run_ranks(_all, 4, cases))


def test_frozen_parameters_are_not_updated():
    model = make("mlp")
    model.head.weight.requires_grad_(False)
    fp = dmuon.plan(model)
    state = dmuon.init(model, fp, CFG)

    def loss_fn(params, x):
        return torch.func.functional_call(model, params, (x,))

    _, grads = dmuon.value_and_grad(loss_fn, fp)(state.params, batch("mlp", 0, 0))
    new = dmuon.update(grads, state, lr=torch.tensor(0.1))
    assert torch.equal(new.params["head.weight"], state.params["head.weight"])
    assert not torch.equal(
        new.params["layers.0.up_proj.weight"], state.params["layers.0.up_proj.weight"]
    )
