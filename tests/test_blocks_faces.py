"""Both faces plan and step parameters made of several matrices: 3-D experts (a batch by
default), a fused qkv given as `blocks`, a conv weight (flattened by default). Each compared with a
single process stepping the same global batch with `muon_update(..., blocks=)` (itself checked
against per-piece Muon in tests/test_update_blocks.py), fp32 Newton-Schulz."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

import dmuon_fn as dmuon
from dmuon_fn import NSConfig
from tests._dist import run_ranks
from tests._models import blocks_reference, full_params

BLOCKS = {"attn.qkv.weight": "rows=16+4+4"}
WANT = {  # what each face must plan
    "attn.qkv.weight": "rows=16+4+4",
    "moe.experts": "batch1",
    "conv.weight": "flatten",
    "head.weight": "matrix",
}
STEPS, LR, WORLD_BATCH = 3, 0.05, 8


class _Attn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(16, 24, bias=False)


class _MoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.Parameter(torch.randn(3, 16, 16) * 0.2)  # (experts, out, in)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.einsum("bi,eoi->bo", h, self.experts).tanh()


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = _Attn()
        self.moe = _MoE()
        self.conv = nn.Conv1d(1, 2, 3, bias=False)
        self.head = nn.Linear(16, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.attn.qkv(x).split([16, 4, 4], dim=-1)
        h = q * torch.cat([k, v, k, v], dim=-1).tanh()
        h = self.moe(h)
        c = self.conv(h[:, None, :]).sum(1)  # (b, 14)
        return self.head(torch.cat([c, h[:, :2]], dim=-1))


def _model() -> Net:
    torch.manual_seed(0)
    return Net()


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(WORLD_BATCH, 16, generator=g), torch.randn(WORLD_BATCH, 4, generator=g)


def _loss(model, x, y):
    return ((model(x) - y) ** 2).mean()


def reference() -> dict[str, torch.Tensor]:
    """One process, the whole batch, `muon_update` per parameter with the planned blocks."""
    return blocks_reference(
        _model(), lambda m, step: _loss(m, *_batch(step)), WANT.__getitem__, STEPS, LR
    )


def _object(rank: int, world: int, hsdp: bool) -> dict:
    torch.manual_seed(1)
    if hsdp:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        shard, rep = mesh["shard"], mesh["replicate"]
    else:
        shard, rep = init_device_mesh("cpu", (world,)), None
    model = _model()
    dmuon.dedicate_params(model, shard, replicate_mesh=rep, pure=True, blocks=BLOCKS)
    plan = model._dmuon_state.plan
    specs = {n: str(plan.blocks_of(n)) for n in WANT}
    opt = dmuon.Muon(model, lr=LR, ns_dtype=torch.float32, weight_decay=0.0)
    per = WORLD_BATCH // world
    for step in range(STEPS):
        x, y = _batch(step)
        _loss(model, x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]).backward()
        opt.step()
        opt.zero_grad()
    opt.wait_publish()
    return {"specs": specs, "params": full_params(model, cast=False)}


def _close(got: dict, want: dict) -> None:
    for n, w in want.items():
        err = (got[n].float() - w).norm() / (w - _model().state_dict()[n]).norm()
        assert err < 1e-4, (n, float(err))


@pytest.mark.slow
@pytest.mark.parametrize(("world", "hsdp"), [(2, False), (4, False), (4, True)])
def test_object_api_steps_blocks_like_one_process(world, hsdp):
    want = reference()
    for r in run_ranks(_object, world, hsdp):
        assert r["specs"] == WANT
        _close(r["params"], want)


def test_functional_plans_and_steps_blocks_like_one_process():
    want = reference()
    model = _model()
    fp = dmuon.plan(model, blocks=BLOCKS)
    assert {n: str(fp.partition.blocks_of(n)) for n in WANT} == WANT
    cfg = dmuon.Config(lr=LR, weight_decay=0.0, ns=NSConfig(dtype=torch.float32))
    state = dmuon.init(model, fp, cfg)

    def loss_fn(params, batch):
        x, y = batch
        return ((torch.func.functional_call(model, params, (x,)) - y) ** 2).mean()

    step_grads = dmuon.value_and_grad(loss_fn, fp)
    for step in range(STEPS):
        _, grads = step_grads(state.params, _batch(step))
        state = dmuon.update(grads, state)
    _close(dmuon.full_params(state), want)


def test_blocks_for_a_name_that_is_not_a_matrix_raise():
    with pytest.raises(ValueError, match=r"'nope\.weight' names none of the Muon matrices"):
        dmuon.plan(_model(), blocks={"nope.weight": "rows/2"})
    with pytest.raises(ValueError, match=r"attn\.qkv\.weight of shape \(24, 16\).*sum"):
        dmuon.plan(_model(), blocks={"attn.qkv.weight": "rows=16+4+5"})


def test_the_compiled_functional_step_with_blocks_is_one_graph_equal_to_eager():
    model = _model()
    fp = dmuon.plan(model, blocks=BLOCKS)
    cfg = dmuon.Config(lr=LR, weight_decay=0.0, ns=NSConfig(dtype=torch.float32))

    def loss_fn(params, batch):
        x, y = batch
        return ((torch.func.functional_call(model, params, (x,)) - y) ** 2).mean()

    vg = dmuon.value_and_grad(loss_fn, fp)

    def step(state, batch):
        return dmuon.update(vg(state.params, batch)[1], state)

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    eager_state = compiled_state = dmuon.init(model, fp, cfg)
    for i in range(2):
        eager_state = step(eager_state, _batch(i))
        compiled_state = compiled(compiled_state, _batch(i))
    for n, v in eager_state.params.items():
        assert torch.equal(compiled_state.params[n], v), n
