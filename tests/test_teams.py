"""Teams (planning/_slices.py, proofs/team_ns.md): a matrix cut along its long side into slices
whose owners run its Newton-Schulz together. Both faces on a model whose tall matrix (cut by
rows) and wide matrix (cut by columns) are on teams of 2 and 4, against one process stepping
the same global batch with `muon_update` (fp32 Newton-Schulz): 1e-5 relative per parameter
after 5 steps; Z2 and Z3, 1-D and 2×2 HSDP, compiled blocks and a fullgraph functional step;
the team collectives' bytes per step equal the formula (`team_bytes`, counted by CommCounter);
checkpoints of a team layout loaded into another and into whole ownership."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

import dmuon_fn as dmuon
from dmuon_fn import NSConfig
from dmuon_fn.ns._cost import team_bytes
from tests._dist import data_meshes, run_ranks
from tests._models import blocks_reference, close_after_steps, full_params, resumed

D, H, OUT = 24, 64, 8
STEPS, LR, WORLD_BATCH = 5, 0.05, 8
UP, DOWN = "blocks.0.up.weight", "blocks.0.down.weight"  # (64, 24) tall, (24, 64) wide


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(D, H, bias=False)
        self.down = nn.Linear(H, D, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(D, OUT, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _model() -> Net:
    torch.manual_seed(0)
    return Net()


def _batch(step: int):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(WORLD_BATCH, D, generator=g), torch.randn(WORLD_BATCH, OUT, generator=g)


def _loss(model, x, y):
    return ((model(x) - y) ** 2).mean()


def reference() -> dict[str, torch.Tensor]:
    return blocks_reference(_model(), lambda m, s: _loss(m, *_batch(s)), lambda n: None, STEPS, LR)


def _close(got: dict, want: dict) -> None:
    close_after_steps(got, want, _model().state_dict())


def _meshes(world: int, hsdp: bool):
    return data_meshes(world, hsdp)


def _team_sizes(hsdp: bool) -> dict[str, int]:
    return {UP: 2, DOWN: 2} if hsdp else {UP: 4, DOWN: 2}


def _object(rank: int, world: int, hsdp: bool, z3: bool, compiled: bool, ahead=False) -> dict:
    shard, rep = _meshes(world, hsdp)
    model = _model()
    teams = _team_sizes(hsdp)
    dmuon.dedicate_params(
        model, shard, replicate_mesh=rep, pure=True, reshard_after_forward=z3, teams=teams
    )
    if compiled:
        torch._dynamo.reset()
        for i, b in enumerate(model.blocks):
            model.blocks.register_module(str(i), torch.compile(b, fullgraph=True))
    plan = model._dmuon_state.plan
    opt = dmuon.Muon(model, lr=LR, ns_dtype=torch.float32, weight_decay=0.0, gather_in_step=ahead)
    per = WORLD_BATCH // world
    booked = []
    for step in range(STEPS):
        x, y = _batch(step)
        _loss(model, x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]).backward()
        with dmuon.CommCounter() as comm:
            opt.step()
        booked.append({k: dict(v.op_bytes) for k, v in comm.stats.items()})
        opt.zero_grad()
    opt.wait_publish()
    return {"teams": {n: plan.pieces(n) for n in plan.teams}, "booked": booked,
            "mine": [n for n in plan.teams if n in model._dmuon_state.teams],
            "params": full_params(model, cast=False)}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(
    ("hsdp", "z3", "compiled", "ahead"),
    [(False, False, False, False), (False, True, False, False), (True, False, False, False),
     (True, True, False, False), (False, True, True, False), (False, True, False, True)],
)  # fmt: skip
def test_object_api_steps_teams_like_one_process(hsdp, z3, compiled, ahead):
    """(ahead: the step also gathers the next forward's parameters, between team updates.)"""
    want = reference()
    for r in run_ranks(_object, 4, hsdp, z3, compiled, ahead):
        assert {n: len(ps) for n, ps in r["teams"].items()} == _team_sizes(hsdp)
        _close(r["params"], want)
        # the team collectives of each step: the formula, for the teams this rank is in
        shapes = dict(_model().named_parameters())
        sizes = _team_sizes(hsdp)
        formula = sum(team_bytes(shapes[n].shape, sizes[n], itemsize=4) for n in r["mine"])
        for step in r["booked"]:
            other = step["other"]
            assert other.get("all_reduce", 0) + other.get("all_gather_into_tensor", 0) == (
                pytest.approx(formula)
            )


def _functional(rank: int, world: int, hsdp: bool, compiled: bool) -> dict:
    shard, rep = _meshes(world, hsdp)
    model = _model()
    fp = dmuon.plan(model, shard, replicate_mesh=rep, teams=_team_sizes(hsdp))
    cfg = dmuon.Config(lr=LR, weight_decay=0.0, ns=NSConfig(dtype=torch.float32))
    state = dmuon.init(model, fp, cfg)
    per = WORLD_BATCH // world

    def loss_fn(params, batch):
        x, y = batch
        return ((torch.func.functional_call(model, params, (x,)) - y) ** 2).mean()

    vg = dmuon.value_and_grad(loss_fn, fp)
    step = lambda state, batch: dmuon.update(vg(state.params, batch)[1], state)  # noqa: E731
    frames = None
    if compiled:
        from torch._dynamo.testing import CompileCounterWithBackend

        torch._dynamo.reset()
        cnt = CompileCounterWithBackend("aot_eager")
        step = torch.compile(step, fullgraph=True, backend=cnt)
    for i in range(STEPS):
        x, y = _batch(i)
        state = step(state, (x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]))
    if compiled:
        frames = cnt.frame_count
    return {"params": dmuon.full_params(state), "frames": frames}


@pytest.mark.slow
@pytest.mark.parametrize(("hsdp", "compiled"), [(False, False), (False, True), (True, True)])
def test_functional_steps_teams_like_one_process(hsdp, compiled):
    want = reference()
    for r in run_ranks(_functional, 4, hsdp, compiled):
        _close(r["params"], want)
        assert r["frames"] in (None, 1)


# ---------------------------------------------------------------- checkpoints


def _checkpoint(rank: int, world: int, path: str, teams: dict, save: bool) -> dict:
    model = _model()
    dmuon.dedicate_params(model, init_device_mesh("cpu", (world,)), pure=True, teams=teams)
    opt = dmuon.Muon(model, lr=LR, ns_dtype=torch.float32, weight_decay=0.0)
    loss_at = lambda m, step, rows: _loss(m, *(t[rows] for t in _batch(step)))  # noqa: E731
    out = resumed(model, opt, path, save, loss_at, rank, world, WORLD_BATCH, STEPS)
    plan = model._dmuon_state.plan
    return {**out, "teams": {n: len(plan.pieces(n)) for n in plan.teams}}


@pytest.mark.slow
def test_a_team_checkpoint_loads_into_other_teams_and_whole_owners(tmp_path):
    path = str(tmp_path / "teams")
    (saved, *_) = run_ranks(_checkpoint, 4, path, {UP: 4, DOWN: 2}, True)
    (other, *_) = run_ranks(_checkpoint, 4, path, {UP: 2, DOWN: 4}, False)
    (whole, *_) = run_ranks(_checkpoint, 2, path, {}, False)
    assert saved["teams"] == {UP: 4, DOWN: 2} and other["teams"] == {UP: 2, DOWN: 4}
    assert whole["teams"] == {}
    for r in (other, whole):
        for n in saved["loaded"]:
            assert torch.equal(r["loaded"][n], saved["loaded"][n]), n
            assert torch.equal(r["momentum"][n], saved["momentum"][n]), n
        _close(r["params"], reference())


def _fn_checkpoint(rank: int, world: int, path: str, teams: dict, save: bool) -> dict:
    model = _model()
    fp = dmuon.plan(model, init_device_mesh("cpu", (world,)), teams=teams)
    cfg = dmuon.Config(lr=LR, weight_decay=0.0, ns=NSConfig(dtype=torch.float32))
    state = dmuon.init(model, fp, cfg)
    per = WORLD_BATCH // world

    def loss_fn(params, batch):
        return ((torch.func.functional_call(model, params, (batch[0],)) - batch[1]) ** 2).mean()

    vg = dmuon.value_and_grad(loss_fn, fp)
    if save:
        for i in range(2):
            x, y = _batch(i)
            grads = vg(
                state.params, (x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per])
            )[1]
            state = dmuon.update(grads, state)
        dmuon.save_state(path, state)
    else:
        state = dmuon.load_state(path, state)
    momentum = {n: s.momentum for n, s in state.opt.items() if isinstance(s, dmuon.MuonState)}
    return {"params": dmuon.full_params(state), "teams": fp.partition.teams,
            "held": {n: tuple(m.shape) for n, m in momentum.items()}}  # fmt: skip


@pytest.mark.slow
def test_a_functional_team_checkpoint_loads_into_whole_owners(tmp_path):
    path = str(tmp_path / "fn")
    saved = run_ranks(_fn_checkpoint, 4, path, {UP: 4, DOWN: 2}, True)
    loaded = run_ranks(_fn_checkpoint, 4, path, {UP: 1, DOWN: 1}, False)
    assert saved[0]["teams"] == (DOWN, UP) and loaded[0]["teams"] == ()
    assert {saved[r]["held"][UP] for r in range(4)} == {(16, D)}  # a quarter of the rows each
    for n, v in saved[0]["params"].items():
        assert torch.equal(loaded[0]["params"][n], v), n
