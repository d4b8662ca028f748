"""Gathered groups (planning/_gathered.py, proofs/partition.md §12): a matrix too heavy in bytes
for its owner is held in pieces on the lightest ranks; the holder of its first piece gathers
the momentum's pieces, orthogonalizes the whole and sends each piece back. Both faces, 1-D and
2×2 HSDP, Z2 and Z3, the functional step compiled fullgraph, against one process stepping the
same global batch with `muon_update` (fp32 Newton-Schulz): 1e-5 relative per parameter after 5
steps; a checkpoint of the gathered layout loads into whole ownership; the plan's claims on
random shapes (hypothesis)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.device_mesh import init_device_mesh

import dmuon_fn as dmuon
from dmuon_fn import NSConfig
from dmuon_fn.planning import _gathered
from dmuon_fn.planning._memory import BALANCED, resident
from dmuon_fn.planning._slices import parse_piece
from tests._dist import data_meshes, run_ranks
from tests._models import blocks_reference, close_after_steps, full_params, resumed
from tests.test_partition import gpt2

D, BIG, OUT = 16, 96, 4
STEPS, LR, WORLD_BATCH = 5, 0.05, 8
BIG_W = "big.weight"  # (96, 16): alone more than 1.10x a rank's mean bytes at 4 ranks
WIDE_W = "wide.weight"  # (16, 288): so is each slice of it on a team of 2, cut by columns
# experts too heavy one by one: (2, 192, 16) at 4 ranks, (1, 288, 16) on 2×2 HSDP; each expert
# is held in pieces of its rows (`experts[e:e+1, a:b]`)
EXPERTS = {False: (2, 192, D), True: (1, 288, D)}


class Net(nn.Module):
    """`wide`: with a (16, 288) matrix too, for a team of 2 on it; `experts`: with a batch of
    matrices of that shape too (E, R, 16), as MoE experts are stored."""

    def __init__(self, wide: bool = False, experts: tuple | None = None) -> None:
        super().__init__()
        self.big = nn.Linear(D, BIG, bias=False)
        self.wide = nn.Linear(3 * BIG, D, bias=False) if wide else None
        self.experts = None if experts is None else nn.Parameter(torch.randn(experts) / D)
        self.small = nn.ModuleList([nn.Linear(D, D, bias=False) for _ in range(3)])
        self.head = nn.Linear(D, OUT, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.big(x))
        x = x + h.view(-1, BIG // D, D).mean(1)
        if self.experts is not None:
            E, R, _ = self.experts.shape
            y = torch.tanh(torch.einsum("bd,erd->ber", x, self.experts))
            x = x + y.reshape(len(x), E * R // D, D).mean(1)
        if self.wide is not None:
            x = x + self.wide(h.repeat(1, 3))
        for layer in self.small:
            x = x + torch.tanh(layer(x))
        return self.head(x)


def _model(wide: bool = False, experts: tuple | None = None) -> Net:
    torch.manual_seed(0)
    return Net(wide, experts)


def _batch(step: int):
    g = torch.Generator().manual_seed(200 + step)
    return torch.randn(WORLD_BATCH, D, generator=g), torch.randn(WORLD_BATCH, OUT, generator=g)


def _loss(model, x, y):
    return ((model(x) - y) ** 2).mean()


def reference(wide: bool = False, experts: tuple | None = None) -> dict[str, torch.Tensor]:
    loss = lambda m, s: _loss(m, *_batch(s))  # noqa: E731
    spec = lambda n: "batch1" if n == "experts" else None  # noqa: E731  (the plan's default)
    return blocks_reference(_model(wide, experts), loss, spec, STEPS, LR)


def _close(got: dict, want: dict, wide: bool = False, experts: tuple | None = None) -> None:
    close_after_steps(got, want, _model(wide, experts).state_dict())


def _meshes(world: int, hsdp: bool):
    _gathered.MIN_PIECE_BYTES = 0  # (in this rank: pieces of this small model are KiBs)
    return data_meshes(world, hsdp)


def _rows(rank: int, world: int):
    per = WORLD_BATCH // world
    return slice(rank * per, (rank + 1) * per)


def _object(rank: int, world: int, hsdp: bool, z3: bool, teams: dict, experts=None) -> dict:
    shard, rep = _meshes(world, hsdp)
    model = _model(bool(teams), experts)
    dmuon.dedicate_params(
        model, shard, replicate_mesh=rep, pure=True, reshard_after_forward=z3, teams=teams
    )  # fmt: skip
    plan = model._dmuon_state.plan
    opt = dmuon.Muon(model, lr=LR, ns_dtype=torch.float32, weight_decay=0.0)
    for step in range(STEPS):
        x, y = _batch(step)
        _loss(model, x[_rows(rank, world)], y[_rows(rank, world)]).backward()
        opt.step()
        opt.zero_grad()
    opt.wait_publish()
    held = resident(plan).imbalance
    params = full_params(model, cast=False)
    sd = _state_dict_round_trip(model, params)
    return {"gathered": plan.gathered, "ns": opt.ns_calls, "teams": plan.teams,
            "params": params, "resident": held, "state_dict": sd}  # fmt: skip


def _state_dict_round_trip(model, params: dict) -> bool:
    """torch's `state_dict()` (each parameter a DTensor of its whole, from its pieces' holders)
    is `params`; `load_state_dict` of it doubled (DTensors, sent back to the pieces' holders)
    and of the plain whole tensors (each holder takes its part) writes them back."""
    sd = model.state_dict()
    whole = {n: v.full_tensor() if hasattr(v, "full_tensor") else v for n, v in sd.items()}
    ok = all(torch.equal(whole[n], params[n]) for n in params)
    model.load_state_dict({n: v * 2 for n, v in sd.items()})
    ok &= all(torch.equal(v, 2 * params[n]) for n, v in full_params(model, cast=False).items())
    model.load_state_dict(whole)
    return ok and all(torch.equal(v, params[n]) for n, v in full_params(model, cast=False).items())


def _team_slices_gathered(plan_gathered, teams) -> bool:
    """Whether a member of a team in `teams` holds its slice as a gathered group, cut along
    the team's dim (the wide matrix's columns)."""
    cuts = [parse_piece(p) for g in plan_gathered for p in g]
    return any(c.param in teams and c.dim == 1 for c in cuts)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("hsdp", "z3", "teams"),
    [(False, False, {}), (False, True, {}), (True, True, {}), (False, True, {WIDE_W: 2})],
)
def test_object_api_steps_gathered_groups_like_one_process(hsdp, z3, teams):
    """With a team of 2 on the wide matrix, each member's slice (its columns, 1.3x a rank's
    mean bytes) is itself gathered: its holder runs the team's Newton-Schulz on it."""
    want = reference(wide=bool(teams))
    results = run_ranks(_object, 4, hsdp, z3, teams)
    groups = results[0]["gathered"]
    heavy = WIDE_W if teams else BIG_W
    assert heavy in {parse_piece(g[0]).param for g in groups} and min(map(len, groups)) >= 2
    assert _team_slices_gathered(groups, teams) == bool(teams)
    before = dmuon.partition(
        {n: tuple(p.shape) for n, p in _model(bool(teams)).named_parameters()}, 4,
        replicate_size=2 if hsdp else 1, balance_bytes=False, teams=teams,
    )  # fmt: skip
    assert results[0]["resident"] < resident(before).imbalance
    for r in results:
        _close(r["params"], want, bool(teams))
        assert r["state_dict"]
    # Newton-Schulz runs once per matrix and step in the job (a team's: once per member): the
    # group's on one rank
    assert results[0]["teams"] == tuple(teams)
    assert sum(r["ns"] for r in results) == STEPS * (5 + teams.get(WIDE_W, 0))


def _fn_setup(world: int, hsdp: bool, teams: dict, experts):
    """The functional face on this rank: (plan, state, value_and_grad of the loss)."""
    shard, rep = _meshes(world, hsdp)
    model = _model(bool(teams), experts)
    fp = dmuon.plan(model, shard, replicate_mesh=rep, teams=teams)
    cfg = dmuon.Config(lr=LR, weight_decay=0.0, ns=NSConfig(dtype=torch.float32))

    def loss_fn(params, batch):
        x, y = batch
        return ((torch.func.functional_call(model, params, (x,)) - y) ** 2).mean()

    return fp, dmuon.init(model, fp, cfg), dmuon.value_and_grad(loss_fn, fp)


def _functional(rank: int, world: int, hsdp: bool, teams: dict, experts=None) -> dict:
    from torch._dynamo.testing import CompileCounterWithBackend

    fp, state, vg = _fn_setup(world, hsdp, teams, experts)
    torch._dynamo.reset()
    cnt = CompileCounterWithBackend("aot_eager")
    step = torch.compile(
        lambda state, batch: dmuon.update(vg(state.params, batch)[1], state),
        fullgraph=True, backend=cnt,
    )  # fmt: skip
    for i in range(STEPS):
        x, y = _batch(i)
        state = step(state, (x[_rows(rank, world)], y[_rows(rank, world)]))
    return {"params": dmuon.full_params(state), "frames": cnt.frame_count,
            "gathered": fp.partition.gathered}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(("hsdp", "teams"), [(False, {}), (True, {}), (False, {WIDE_W: 2})])
def test_a_compiled_functional_step_runs_gathered_groups_like_one_process(hsdp, teams):
    want = reference(wide=bool(teams))
    for r in run_ranks(_functional, 4, hsdp, teams):
        assert r["gathered"] and r["frames"] == 1
        assert _team_slices_gathered(r["gathered"], teams) == bool(teams)
        _close(r["params"], want, bool(teams))


def _rows_of_one_expert(groups) -> bool:
    """Whether an expert is held in pieces of its rows (dim 1 within one index of dim 0)."""
    cuts = [parse_piece(g[0]) for g in groups]
    return any(c.param == "experts" and c.outer is not None and c.dim == 1 for c in cuts)


@pytest.mark.slow
@pytest.mark.parametrize(("hsdp", "face"), [(False, "object"), (True, "object"), (False, "fn")])
def test_an_experts_rows_gathered_step_like_one_process(hsdp, face):
    """An expert alone over 1.10x a rank's mean bytes: its rows are held in a gathered group
    (`experts[e:e+1, a:b]`, dim 1 within its one index), its Newton-Schulz on the first
    piece's holder; the object face with Z3 and the compiled functional step."""
    experts = EXPERTS[hsdp]
    want = reference(experts=experts)
    if face == "object":
        results = run_ranks(_object, 4, hsdp, True, {}, experts)
    else:
        results = run_ranks(_functional, 4, hsdp, {}, experts)
    assert _rows_of_one_expert(results[0]["gathered"])
    for r in results:
        _close(r["params"], want, experts=experts)
        assert face != "object" or r["state_dict"]
    if face == "object":  # once per matrix (an expert each) and step in the job
        assert sum(r["ns"] for r in results) == STEPS * (5 + experts[0])


def _checkpoint(rank: int, world: int, path: str, teams: dict, save: bool, experts=None) -> dict:
    _gathered.MIN_PIECE_BYTES = 0
    model = _model(experts=experts)
    dmuon.dedicate_params(model, init_device_mesh("cpu", (world,)), pure=True, teams=teams)
    opt = dmuon.Muon(model, lr=LR, ns_dtype=torch.float32, weight_decay=0.0)
    loss_at = lambda m, step, rows: _loss(m, *(t[rows] for t in _batch(step)))  # noqa: E731
    out = resumed(model, opt, path, save, loss_at, rank, world, WORLD_BATCH, STEPS)
    return {**out, "gathered": model._dmuon_state.plan.gathered}


@pytest.mark.slow
def test_a_gathered_checkpoint_loads_into_whole_owners_and_back(tmp_path):
    path = str(tmp_path / "gathered")
    (saved, *_) = run_ranks(_checkpoint, 4, path, {}, True)
    (whole, *_) = run_ranks(_checkpoint, 4, path, {BIG_W: 1}, False)
    assert saved["gathered"] and not whole["gathered"]
    for n in saved["loaded"]:
        assert torch.equal(whole["loaded"][n], saved["loaded"][n]), n
        assert torch.equal(whole["momentum"][n], saved["momentum"][n]), n
    _close(whole["params"], reference())


def _fn_checkpoint(rank: int, world: int, path: str, save: bool, experts) -> dict:
    """The functional face: `save`, steps [0, 2) then save_state; else load_state into a fresh
    state; then steps [2, STEPS); the values loaded and after, whole, with the plan's groups."""
    fp, state, vg = _fn_setup(world, False, {}, experts)

    def train(steps, state):
        for i in steps:
            x, y = _batch(i)
            grads = vg(state.params, (x[_rows(rank, world)], y[_rows(rank, world)]))[1]
            state = dmuon.update(grads, state)
        return state

    if save:
        state = train(range(2), state)
        dmuon.save_state(path, state)
    else:
        state = dmuon.load_state(path, state)
    loaded = dmuon.full_params(state)
    state = train(range(2, STEPS), state)
    return {"loaded": loaded, "params": dmuon.full_params(state), "gathered": fp.partition.gathered}


@pytest.mark.slow
def test_an_experts_rows_functional_checkpoint_loads_on_2_ranks(tmp_path):
    """The functional face saves each expert's row pieces (DCP chunks at their offsets) and
    loads them on 2 ranks, where each expert is one rank's: the same values, then the same
    steps as one process (momentum loaded too)."""
    path, experts = str(tmp_path / "fn_rows"), EXPERTS[False]
    (saved, *_) = run_ranks(_fn_checkpoint, 4, path, True, experts)
    (whole, *_) = run_ranks(_fn_checkpoint, 2, path, False, experts)
    assert _rows_of_one_expert(saved["gathered"]) and not whole["gathered"]
    for n in saved["loaded"]:
        assert torch.equal(whole["loaded"][n], saved["loaded"][n]), n
    _close(whole["params"], reference(experts=experts), experts=experts)
    _close(saved["params"], reference(experts=experts), experts=experts)


@pytest.mark.slow
def test_an_experts_rows_checkpoint_loads_into_whole_owners(tmp_path):
    """Saved on 4 ranks with each expert in pieces of its rows, loaded on 2, where each expert
    is one rank's."""
    path, experts = str(tmp_path / "rows"), EXPERTS[False]
    (saved, *_) = run_ranks(_checkpoint, 4, path, {}, True, experts)
    (whole, *_) = run_ranks(_checkpoint, 2, path, {}, False, experts)
    assert _rows_of_one_expert(saved["gathered"]) and not whole["gathered"]
    for n in saved["loaded"]:
        assert torch.equal(whole["loaded"][n], saved["loaded"][n]), n
        assert torch.equal(whole["momentum"][n], saved["momentum"][n]), n
    _close(whole["params"], reference(experts=experts), experts=experts)


# ------------------------------------------------------------------------- the plan's claims


@st.composite
def _shapes(draw):
    n = draw(st.integers(1, 8))
    out = {f"layers.{i}.w": (draw(st.integers(1, 300)), draw(st.integers(1, 64))) for i in range(n)}
    if draw(st.booleans()):
        out["experts"] = (draw(st.integers(2, 16)), draw(st.integers(2, 64)), 16)
    return out


@settings(max_examples=60, deadline=None)
@given(_shapes(), st.sampled_from([(2, 1), (4, 1), (8, 1), (8, 2), (16, 4)]))
def test_gathered_groups_keep_ns_loads_columns_and_lower_the_peak(shapes, mesh):
    least, _gathered.MIN_PIECE_BYTES = _gathered.MIN_PIECE_BYTES, 0
    try:
        _claims(shapes, *mesh)
    finally:
        _gathered.MIN_PIECE_BYTES = least


def test_no_piece_below_the_least_worth_a_message():
    small = dmuon.partition({"big": (256, 512), "small": (64, 64)}, 8)
    assert not small.gathered  # pieces of 1/8 MiB: not worth their all-to-all
    named = {n: s for n, s in gpt2().items() if len(s) == 2}  # GPT-2's 48 block matrices
    plan = dmuon.partition(named, 64)
    before = dmuon.partition(named, 64, _gather=False)
    assert plan.gathered and resident(plan).imbalance < resident(before).imbalance
    least = _gathered.MIN_PIECE_BYTES
    for group in plan.gathered:
        assert all(8 * math.prod(plan.shape(p)) >= least for p in group[1:]), group


def _claims(shapes: dict, world: int, replicas: int) -> None:
    before = dmuon.partition(shapes, world, replicate_size=replicas, _gather=False)
    plan = dmuon.partition(shapes, world, replicate_size=replicas)
    G = plan.shard_size

    # every slot's Newton-Schulz FLOPs are what they were: a group's stay on its first piece
    def ns(p):
        return [math.fsum(f for f, s in zip(p.ns_flops, p.slots, strict=True) if s == t)
                for t in range(world)]  # fmt: skip

    assert ns(plan) == pytest.approx(ns(before), rel=1e-12, abs=0)
    # the pieces' per-byte costs take no slot over LOAD_SLACK times the busiest load
    assert max(plan.slot_loads) <= max(before.slot_loads) * _gathered.LOAD_SLACK * (1 + 1e-9)
    # resident bytes: the peak never rises; nothing is cut in a balanced plan
    assert max(resident(plan).total) <= max(resident(before).total)
    if resident(before).imbalance <= BALANCED:
        assert not plan.gathered
    for group in plan.gathered:
        cuts = [parse_piece(p) for p in group]
        slots = [plan.slot(p) for p in group]
        team = cuts[0].param in plan.teams  # a member's slice: cut as its team's are
        (dim, outer), *more = {(c.dim, c.outer) for c in cuts}  # one cut for the whole group
        assert not more
        if team:  # along the dim its team's slices are
            assert dim == parse_piece(plan.pieces(cuts[0].param)[0]).dim and outer is None
        else:  # along dim 0, or one expert's rows (dim 1 within its one index of dim 0)
            assert (dim, outer) == (0, None) or (dim == 1 and outer[1] - outer[0] == 1)
        assert all(a.stop == b.start for a, b in itertools.pairwise(cuts))
        assert len({s % G for s in slots}) == len(slots)  # distinct shard columns
        assert all(plan.ns_flops[plan._index(p)] == 0 for p in group[1:])
        # a slot that took a piece, and its column's slots that hold the piece's HSDP copies,
        # end within the bound
        held = resident(plan).total
        bound = BALANCED * sum(held) / world
        for t in slots[1:]:
            assert all(held[c] <= bound for c in range(t % G, world, G)), (group, t)
    for name in before.teams:  # a team's members stay, each one slice's first piece
        assert [plan.slot(p) for p in plan.team(name)] == [
            before.slot(p) for p in before.team(name)
        ]
    for name, pieces in plan.sliced:  # a parameter's pieces: distinct columns, covering it
        assert len({plan.slot(p) % G for p in pieces}) == len(pieces), name
        x = torch.arange(math.prod(shapes[name])).view(shapes[name])  # each element once
        got = torch.cat([x[parse_piece(p).index].reshape(-1) for p in pieces])
        assert torch.equal(got.sort().values, x.reshape(-1)), name
        assert all(tuple(x[parse_piece(p).index].shape) == plan.shape(p) for p in pieces), name
    assert plan.digest() == dmuon.partition(shapes, world, replicate_size=replicas).digest()
