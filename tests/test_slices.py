"""Slices: an expert tensor too costly for one owner is cut along its expert dim into pieces owned
by different ranks (planning/_slices.py). The planner's invariants, then both faces on a model
with 3-D experts (gate/up blocks per expert), a fused qkv (GQA sizes) and per-head q/k, each
compared with a single process stepping the same global batch with `muon_update(..., blocks=)`
(checked against per-piece Muon in tests/test_update_blocks.py), fp32 Newton-Schulz; and
checkpoints of a sliced model re-planned on another world size."""

from __future__ import annotations

import itertools
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.device_mesh import init_device_mesh

import dmuon_fn as dmuon
from dmuon_fn import NSConfig
from dmuon_fn.planning._partition import partition
from dmuon_fn.planning._slices import (
    _lpt,
    _pair_bound,
    _TeamSizes,
    best_sizing,
    cuts,
    join,
    parse_piece,
    piece_name,
    take,
)
from tests._dist import run_ranks
from tests._models import blocks_reference, full_params, resumed

E, D = 4, 16
BLOCKS = {  # per-head q (4 heads) and k (2 heads), fused qkv with GQA sizes, gate/up per expert
    "*.attn.qkv.weight": "rows=16+8+8",
    "*.attn.q.weight": "rows/4",
    "*.attn.k.weight": "rows/2",
    "*.experts_gate_up": "batch1,rows=16+16",
}
STEPS, LR, WORLD_BATCH = 3, 0.05, 8
EXPERTS = ("layers.0.experts_gate_up", "layers.1.experts_gate_up")


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.ModuleDict(
            {"qkv": nn.Linear(D, 32, bias=False), "q": nn.Linear(D, D, bias=False),
             "k": nn.Linear(D, 8, bias=False)}
        )  # fmt: skip
        self.experts_gate_up = nn.Parameter(torch.randn(E, 2 * D, D) * 0.2)  # (E, gate+up, in)
        self.experts_down = nn.Parameter(torch.randn(E, D, D) * 0.2)  # (E, out, in)
        self.router = nn.Linear(D, E, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.attn["qkv"](x).split([16, 8, 8], dim=-1)
        h = x + 0.5 * (q * torch.cat([k, v], -1).tanh() + self.attn["q"](x)) * 0.5
        h = h + torch.cat([self.attn["k"](x)] * 2, -1).tanh()
        w = self.router(h).softmax(-1)  # (b, E): every expert weighted, dense
        gu = torch.einsum("bi,eoi->beo", h, self.experts_gate_up)
        gate, up = gu.split(D, dim=-1)
        y = torch.einsum("beo,eio->bei", torch.nn.functional.silu(gate) * up, self.experts_down)
        return h + (w[..., None] * y).sum(1)


class MoENet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer() for _ in range(2))
        self.head = nn.Linear(D, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _model() -> MoENet:
    torch.manual_seed(0)
    return MoENet()


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(WORLD_BATCH, D, generator=g), torch.randn(WORLD_BATCH, 4, generator=g)


def _loss(model, x, y):
    return ((model(x) - y) ** 2).mean()


def _spec(name: str) -> str:
    hit = [v for k, v in BLOCKS.items() if name.endswith(k[1:])]
    return hit[0] if hit else ("batch1" if "experts" in name else "matrix")


def reference(steps: int = STEPS) -> dict[str, torch.Tensor]:
    """One process, the whole batch, `muon_update` per whole parameter with its blocks."""
    return blocks_reference(_model(), lambda m, step: _loss(m, *_batch(step)), _spec, steps, LR)


def _close(got: dict, want: dict) -> None:
    init = _model().state_dict()
    for n, w in want.items():
        err = (got[n].float() - w).norm() / (w - init[n]).norm()
        assert err < 1e-4, (n, float(err))


def _meshes(world: int, hsdp: bool):
    if hsdp:
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
        return mesh["shard"], mesh["replicate"]
    return init_device_mesh("cpu", (world,)), None


def _owners(plan) -> dict[str, set]:
    return {n: {plan.owner(p) for p in ps} for n, ps in plan.sliced}


# ---------------------------------------------------------------- the planner


@settings(max_examples=200, deadline=None)
@given(st.floats(0.0, 1e9), st.floats(0.0, 1e9), st.integers(1, 300), st.integers(1, 64))
def test_cuts_are_near_equal_and_at_most_one_per_column(cost, mean, length, columns):
    at = cuts(cost, mean, length, columns)
    k = len(at) - 1
    assert at[0] == 0 and at[-1] == length and 1 <= k <= min(length, columns)
    sizes = [b - a for a, b in itertools.pairwise(at)]
    assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1
    if k > 1:  # cut only what costs more than a fair share, into pieces of about half a share
        assert 0 < mean < cost and k - 1 < 2 * cost / mean  # k <= ⌈2·cost / mean⌉


COSTS = st.lists(st.floats(0.0, 1e6), max_size=40)


@settings(max_examples=200, deadline=None)
@given(COSTS, COSTS, st.integers(1, 9))
def test_team_caps_are_pruned_only_below_what_lpt_reaches(items, rest, world):
    """The planner skips a sizing whose lower bounds (the largest cost, the mean load; two of
    the world + 1 largest costs on one slot) exceed the best LPT so far; sound because LPT's
    busiest slot never lies below them, and LPT's loads add up to the costs (each placed once)."""
    items, rest = sorted(items, reverse=True), sorted(rest, reverse=True)
    loads = _lpt(items, rest, world)
    assert list(loads) == sorted(loads, reverse=True) and len(loads) == min(4, world)
    every = items + rest
    bound = max(max(every, default=0.0), sum(every) / world)
    assert loads[0] >= bound * (1 - 1e-12)
    assert loads[0] >= _pair_bound(items, rest, world) * (1 - 1e-12)
    if world <= 4:
        assert sum(loads) == pytest.approx(sum(every), rel=1e-9, abs=1e-6)


SHAPE = st.tuples(st.integers(1, 40), st.integers(1, 40))


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.tuples(SHAPE, st.integers(1, 3)), min_size=1, max_size=3),
    COSTS,
    st.integers(2, 12),
    st.floats(0.0, 50.0),
)
def test_the_team_sizing_is_the_best_of_every_cap(big, rest, columns, comm):
    """Every sizing a member cost cap gives is weighed: `best_sizing` returns the lightest
    LPT (4 heaviest slots as a tuple) over all of them, each sizing's bound lies below its
    LPT, and every team fits its matrix and the shard columns."""

    def member(sh, share, k):  # compute shrinking with the share, collectives growing with k
        return min(sh) * share + comm * min(sh) ** 2 * (k - 1) / k

    shapes = [sh for sh, n in big for _ in range(n)]
    sizes = _TeamSizes([(sh, member(sh, max(sh), 1) + 1.0) for sh in shapes], columns, member)
    rest = sorted(rest, reverse=True)
    ranked = sizes.ranked(rest, columns)
    every = {tuple(sorted(ks.items())): _lpt(sizes.items(ks), rest, columns) for _, ks in ranked}
    assert len(every) == len(ranked)  # distinct sizings
    for bound, ks in ranked:
        assert _lpt(sizes.items(ks), rest, columns)[0] >= bound * (1 - 1e-12)
        for sh, k in ks.items():  # 1: the matrix stays whole
            assert 1 <= k <= max(1, min(max(sh), columns))
    ks, loads = best_sizing(sizes, rest, columns)
    assert loads == min(every.values())
    assert every[tuple(sorted(ks.items()))] == loads


def test_piece_names_round_trip_and_reject_other_names():
    assert parse_piece(piece_name("a.b[0:1].w", 8, 16)) == ("a.b[0:1].w", 8, 16, 0, None)
    assert piece_name("a.w", 8, 16, dim=1) == "a.w[:, 8:16]"
    assert parse_piece("a.w[:, 8:16]") == ("a.w", 8, 16, 1, None)
    # rows [8, 16) of expert 3 (§12: one expert's rows in a gathered group)
    assert piece_name("e", 8, 16, dim=1, outer=(3, 4)) == "e[3:4, 8:16]"
    assert parse_piece("e[3:4, 8:16]") == ("e", 8, 16, 1, (3, 4))
    with pytest.raises(ValueError, match="cut along dim 1"):
        piece_name("e", 8, 16, dim=0, outer=(3, 4))
    bad = ("a.w", "a.w[1:]", "a.w[01:3]", "a.w[2:0]", "a.w[:,8:16]", "a.w[:, 1:2, 3:4]")
    for name in bad:
        with pytest.raises(ValueError, match="not a piece name"):
            parse_piece(name)


@st.composite
def _tiling(draw):
    """(shape, piece names in order) of a 3-D parameter cut along dim 0, some single experts
    cut again into runs of their rows, as the planner and §12 cut them."""
    E, R = draw(st.integers(1, 6)), draw(st.integers(1, 9))
    edges = sorted(draw(st.sets(st.integers(1, E - 1), max_size=E - 1))) if E > 1 else []
    names = []
    for a, b in itertools.pairwise([0, *edges, E]):
        rows = sorted(draw(st.sets(st.integers(1, R - 1), max_size=3))) if R > 1 else []
        if b - a == 1 and rows and draw(st.booleans()):
            spans = itertools.pairwise([0, *rows, R])
            names += [piece_name("w", r, q, 1, (a, b)) for r, q in spans]
        else:
            names.append(piece_name("w", a, b))
    return (E, R, 3), names


@settings(max_examples=100, deadline=None)
@given(_tiling())
def test_pieces_take_and_join_back_to_their_parameter(tiling):
    """`take` gives each piece's view of its parameter (at its `offsets`); `join` of the pieces
    in order is the parameter, bit for bit; the pieces' sizes add up to it."""
    shape, names = tiling
    x = torch.randn(shape)
    parts = [take(x, n) for n in names]
    assert torch.equal(join(names, parts), x)
    assert sum(p.numel() for p in parts) == x.numel()
    for n, p in zip(names, parts, strict=True):
        at = parse_piece(n).offsets
        assert p.data_ptr() == x[at].data_ptr()  # a view, where its offsets say


@pytest.mark.parametrize(("world", "reps"), [(4, 1), (4, 2), (8, 2), (64, 1)])
def test_the_expert_tensors_are_sliced_over_distinct_columns(world, reps):
    shapes = {n: tuple(p.shape) for n, p in _model().named_parameters()}
    plan = partition(shapes, world, replicate_size=reps, blocks=BLOCKS_PLAIN)
    sliced = dict(plan.sliced)
    assert set(EXPERTS) <= set(sliced)
    for n, ps in sliced.items():
        cols = [plan.coords(plan.slot(p))[0] for p in ps]
        assert len(set(cols)) == len(cols) >= 2
        assert str(plan.blocks_of(n)) == str(plan.blocks_of(ps[0])) == _spec(n)
    whole = partition(shapes, world, replicate_size=reps, blocks=BLOCKS_PLAIN, slices=False)
    assert not whole.sliced and max(plan.slot_loads) <= max(whole.slot_loads)
    if world // reps > 4:  # four expert tensors: slices beat whole ones on more columns
        assert max(plan.slot_loads) < max(whole.slot_loads)


BLOCKS_PLAIN = {f"layers.{i}.{k[2:]}": v for k, v in BLOCKS.items() for i in range(2)}


def test_no_slices_on_one_shard_column_or_for_a_single_matrix():
    shapes = {"e": (8, 64, 64), "w": (512, 512), "n": (4,)}
    assert not partition(shapes, 4, replicate_size=4).sliced  # one shard column
    # by seconds `w` dominates and is one matrix; `e` holds 0.44 of a rank's fair share of
    # bytes, so the byte balance cuts it into pieces of at most about a quarter share
    assert partition(shapes, 4, balance_bytes=False).sliced == ()
    cut = partition(shapes, 4)
    assert dict(cut.sliced)["e"] == ("e[0:4]", "e[4:8]")
    # `w` holds most of the bytes: gathered pieces (proofs/partition.md §12), one NS owner
    assert cut.gathered == (dict(cut.sliced)["w"],) and set(dict(cut.sliced)) == {"e", "w"}
    assert dict(partition({"e": (8, 64, 64)}, 4).sliced)["e"] == tuple(
        piece_name("e", a, a + 2) for a in range(0, 8, 2)
    )
    plan = partition({"e": (8, 64, 64)}, 4)
    assert plan.digest() != partition({"e": (8, 64, 64)}, 4, slices=False).digest()


# ---------------------------------------------------------------- the object API


def _object(rank: int, world: int, hsdp: bool, z3: bool, compiled: bool) -> dict:
    shard, rep = _meshes(world, hsdp)
    model = _model()
    owners = dmuon.dedicate_params(
        model, shard, replicate_mesh=rep, pure=True, blocks=BLOCKS, reshard_after_forward=z3
    )
    if compiled:
        torch._dynamo.reset()
        for i, layer in enumerate(model.layers):
            model.layers.register_module(str(i), torch.compile(layer, fullgraph=True))
    plan = model._dmuon_state.plan
    opt = dmuon.Muon(model, lr=LR, ns_dtype=torch.float32, weight_decay=0.0)
    per = WORLD_BATCH // world
    for step in range(STEPS):
        x, y = _batch(step)
        _loss(model, x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]).backward()
        opt.step()
        opt.zero_grad()
    opt.wait_publish()
    held = {e.name: tuple(e.param.shape) for e in model._dmuon_state.entries if e.param.numel()}
    return {
        "owners": owners,
        "sliced": _owners(plan),
        "held": held,
        "params": full_params(model, cast=False),
    }


@pytest.mark.slow
@pytest.mark.parametrize(
    ("hsdp", "z3", "compiled"),
    [(False, False, False), (False, True, False), (True, False, False), (True, True, False),
     (False, True, True)],
)  # fmt: skip
def test_object_api_steps_sliced_experts_like_one_process(hsdp, z3, compiled):
    want = reference()
    results = run_ranks(_object, 4, hsdp, z3, compiled)
    for r in results:
        _close(r["params"], want)
        for n in EXPERTS:  # one expert tensor's slices on two or more owners
            assert len(r["sliced"][n]) >= 2, r["sliced"]
            pieces = [p for p in r["owners"] if p.startswith(n + "[")]
            assert len(pieces) >= 2
    for n in EXPERTS:  # no rank holds all experts; each holds at most one piece of a tensor
        for r in results:
            mine = [p for p in r["held"] if p.startswith(n + "[")]
            assert len(mine) <= 1 and all(r["held"][p][0] < E for p in mine)


# ---------------------------------------------------------------- the functional API


def _functional(rank: int, world: int, hsdp: bool, staged: bool) -> dict:
    shard, rep = _meshes(world, hsdp)
    model = _model()
    fp = dmuon.plan(model, shard, replicate_mesh=rep, blocks=BLOCKS)
    cfg = dmuon.Config(lr=LR, weight_decay=0.0, ns=NSConfig(dtype=torch.float32))
    state = dmuon.init(model, fp, cfg)
    per = WORLD_BATCH // world
    if staged:
        names = [n for n, _ in model.named_parameters()]

        def stage(i):
            mine = [n for n in names if n.startswith(f"layers.{i}.")]

            def fn(params, x, batch):
                x = batch[0] if x is None else x
                sub = {n.split(".", 2)[2]: params[n] for n in mine}
                return torch.func.functional_call(model.layers[i], sub, (x,))

            return mine, fn

        def last(params, x, batch):
            return ((x @ params["head.weight"].T - batch[1]) ** 2).mean()

        vg = dmuon.value_and_grad([stage(0), stage(1), (["head.weight"], last)], fp)
        step = lambda state, batch: dmuon.update(vg(state.params, batch)[1], state)  # noqa: E731
    else:

        def loss_fn(params, batch):
            x, y = batch
            return ((torch.func.functional_call(model, params, (x,)) - y) ** 2).mean()

        vg = dmuon.value_and_grad(loss_fn, fp)
        torch._dynamo.reset()
        step = torch.compile(
            lambda state, batch: dmuon.update(vg(state.params, batch)[1], state),
            fullgraph=True,
            backend="aot_eager",
        )
    for i in range(STEPS):
        x, y = _batch(i)
        state = step(state, (x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]))
    return {"params": dmuon.full_params(state), "sliced": _owners(fp.partition)}


@pytest.mark.slow
@pytest.mark.parametrize(("hsdp", "staged"), [(False, False), (True, False), (False, True)])
def test_functional_steps_sliced_experts_like_one_process(hsdp, staged):
    want = reference()
    for r in run_ranks(_functional, 4, hsdp, staged):
        assert all(len(r["sliced"][n]) >= 2 for n in EXPERTS)
        _close(r["params"], want)


# ---------------------------------------------------------------- checkpoints


def _checkpoint(rank: int, world: int, path: str, save: bool) -> dict:
    shard = init_device_mesh("cpu", (world,))
    model = _model()
    dmuon.dedicate_params(model, shard, pure=True, blocks=BLOCKS)
    opt = dmuon.Muon(model, lr=LR, ns_dtype=torch.float32, weight_decay=0.0)
    loss_at = lambda m, step, rows: _loss(m, *(t[rows] for t in _batch(step)))  # noqa: E731
    out = resumed(model, opt, path, save, loss_at, rank, world, WORLD_BATCH, STEPS)
    return {**out, "pieces": dict(model._dmuon_state.plan.sliced)}


@pytest.mark.slow
def test_a_sliced_checkpoint_resumes_on_4_and_replans_on_2(tmp_path):
    path = str(Path(tmp_path, "moe"))
    (saved, *_) = run_ranks(_checkpoint, 4, path, True)
    (same, *_) = run_ranks(_checkpoint, 4, path, False)
    (two, *_) = run_ranks(_checkpoint, 2, path, False)
    assert two["pieces"] != saved["pieces"]  # re-planned: other cuts
    for n, v in saved["params"].items():  # 4 -> 4: the resumed run is the uninterrupted one
        assert torch.equal(same["params"][n], v), n
    for r in (same, two):
        for n in saved["loaded"]:
            assert torch.equal(r["loaded"][n], saved["loaded"][n]), n
            assert torch.equal(r["momentum"][n], saved["momentum"][n]), n
    _close(two["params"], reference())


def test_a_checkpoint_records_the_blocks_and_a_load_under_others_warns(tmp_path):
    model, path = _model(), str(Path(tmp_path, "c"))
    state = dmuon.init(model, dmuon.plan(model, blocks=BLOCKS), dmuon.Config())
    dmuon.save_state(path, state)
    saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    assert {k for k in saved if k.startswith("blocks.")} == {
        f"blocks.{n}" for n, p in model.named_parameters() if p.ndim >= 2
    }
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dmuon.load_state(path, state)  # the same specs: silent
    other = dmuon.plan(model, blocks={**BLOCKS, "*.attn.q.weight": "rows/2"})
    with pytest.warns(UserWarning, match=r"layers\.0\.attn\.q\.weight .*'rows/4'.*'rows/2'"):
        dmuon.load_state(path, dmuon.init(model, other, dmuon.Config()))


def _freeze(rank: int, world: int) -> dict:
    model = _model()
    dmuon.dedicate_params(model, init_device_mesh("cpu", (world,)), pure=True, blocks=BLOCKS)
    opt = dmuon.Muon(model, lr=LR, ns_dtype=torch.float32, weight_decay=0.0)
    per, out = WORLD_BATCH // world, []
    for step in range(3):
        if step == 1:  # every rank freezes the parameter it holds a piece (or nothing) of
            model.layers[0].experts_gate_up.requires_grad_(False)
        x, y = _batch(step)
        _loss(model, x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]).backward()
        opt.step()
        opt.zero_grad()
        out.append(full_params(model, cast=False))
    return {"params": out}


@pytest.mark.slow
def test_a_frozen_sliced_parameter_stays_frozen_on_every_rank():
    (r, *_) = run_ranks(_freeze, 4)
    frozen, live = EXPERTS[0], EXPERTS[1]
    assert torch.equal(r["params"][0][frozen], r["params"][2][frozen])
    assert not torch.equal(r["params"][0][live], r["params"][2][live])
