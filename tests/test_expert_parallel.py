"""Expert parallelism: 3-D expert parameters `Shard(0)` over the 'ep' dim of a (dp, ep) mesh are
orthogonalized where they lie, each expert rank its own experts, with no exchange
(proofs/tensor_parallel.md claim 11).

The model: a plain input projection and router (whole copies on every expert rank), experts
`gate_up` (E, 2F, D), read as "batch1,rows=F+F", and `down` (E, D, F), the default batch, both
Shard(0) over 'ep' with E = 3 (uneven: 2 + 1 experts), a column-parallel head (rows split over
'ep', exchanged as any tensor-parallel matrix) and a LayerNorm (FSDP2, AdamW). The reference is
one process running plain Muon per expert block (tests/_models.reference). Also: HSDP + EP,
checkpoints across expert-parallel degrees, an expert rank holding no expert, the refusals, and
the plan's tensor slots and per-rank shares.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

import dmuon_fn as dmuon
from dmuon_fn.planning._tensor import LOCAL
from tests._dist import run_ranks
from tests._models import HP, full_params, muon_fp32, reference

E, D, FF, V = 3, 16, 8, 12
STEPS = 4
TOL = 1e-4  # as tests/test_tensor_parallel.py
BLOCKS = {"experts.gate_up": f"batch1,rows={FF}+{FF}"}


class Experts(nn.Module):
    """E gated MLP experts; every token goes through each, weighted by its gate (dense, so every
    expert has a gradient every step). Expert parallel: this rank's experts, their outputs summed
    over the expert ranks."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.gate_up = nn.Parameter(torch.randn(n, 2 * FF, D) / math.sqrt(D))
        self.down = nn.Parameter(torch.randn(n, D, FF) / math.sqrt(FF))

    def forward(self, x: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
        w1, w2, mesh, lo = self.gate_up, self.down, None, 0
        if isinstance(w1, DTensor):
            mesh = w1.device_mesh
            n = self.gate_up.shape[0]
            lo = mesh.get_local_rank() * -(-n // mesh.size())  # torch.chunk's first expert
            w1, w2 = w1.to_local(), w2.to_local()
            x, gates = _Copy.apply(x, mesh.get_group()), _Copy.apply(gates, mesh.get_group())
        a, b = torch.einsum("nd,efd->enf", x, w1).chunk(2, dim=-1)
        y = torch.einsum("enf,edf->end", F.silu(a) * b, w2)
        y = torch.einsum("ne,end->nd", gates[:, lo : lo + w1.shape[0]], y)
        return y if mesh is None else _Sum.apply(y, mesh.get_group())


def _sum(t: torch.Tensor, group) -> torch.Tensor:
    t = t.clone()
    dist.all_reduce(t, group=group)
    return t


class _Sum(torch.autograd.Function):
    """The sum of the expert ranks' outputs; backward: the gradient as it is (every expert rank
    computes the same loss from the sum)."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, group) -> torch.Tensor:
        return _sum(y, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _Copy(torch.autograd.Function):
    """An input every expert rank computes with; backward: the sum of their gradients (each has
    its own experts' part of it)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _sum(grad, ctx.group), None


class MoE(nn.Module):
    def __init__(self, n: int = E) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.inp = nn.Linear(D, D, bias=False)
        self.router = nn.Linear(D, n, bias=False)
        self.experts = Experts(n)
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, V, bias=False)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        h = h + self.experts(h, self.router(h).softmax(-1))
        return F.cross_entropy(self.head(self.norm(h)), y)


def batch(step: int, data_rank: int = 0, data_size: int = 1):
    """Data rank `data_rank`'s rows of step `step`'s global batch of 8 (equal parts)."""
    g = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(8, D, generator=g), torch.randint(0, V, (8,), generator=g)
    rows = slice(data_rank * 8 // data_size, (data_rank + 1) * 8 // data_size)
    return x[rows], y[rows]


def parallelize(model: MoE, ep_mesh, experts_dim: int = 0) -> MoE:
    """The experts Shard(experts_dim) over `ep_mesh`, the head column-parallel."""
    for name in ("gate_up", "down"):
        p = getattr(model.experts, name)
        dp = distribute_tensor(p.detach(), ep_mesh, [Shard(experts_dim)])
        setattr(model.experts, name, nn.Parameter(dp))
    return parallelize_module(model, ep_mesh, {"head": ColwiseParallel(output_layouts=Replicate())})


def _experts_only(name: str, p) -> bool:
    return "experts" in name


def _matrices(name: str, p) -> bool:
    return p.ndim >= 2


PREDICATES = {"all": _matrices, "experts": _experts_only}


def _setup(world, which, z3, T=2, n=E, hsdp=False):
    """The model of `n` experts on a (dp, ep T) mesh of `world` ranks (hsdp: (replicate 2,
    shard, ep T)), dedicated and sharded, and its Muon."""
    kw = dict(blocks=BLOCKS, reshard_after_forward=z3)
    if hsdp:
        names = ("replicate", "shard", "ep")
        mesh = init_device_mesh("cpu", (2, world // 2 // T, T), mesh_dim_names=names)
        shard, data = mesh["shard"], mesh["replicate", "shard"]
        kw["replicate_mesh"] = mesh["replicate"]
    else:
        mesh = init_device_mesh("cpu", (world // T, T), mesh_dim_names=("dp", "ep"))
        shard = data = mesh["dp"]
    model = parallelize(MoE(n), mesh["ep"])
    dmuon.dedicate_params(model, shard, PREDICATES[which], **kw)
    fully_shard(model, mesh=data)
    return model, muon_fp32(model)


def _steps(model, opt, steps, rank, world, T=2, comm=None):
    for step in steps:
        opt.zero_grad()
        model(*batch(step, rank // T, world // T)).backward()
        with comm.phase("step") if comm else contextlib.nullcontext():
            opt.step()
    opt.wait_publish()


def _train(rank, world, which, z3, hsdp):
    T = 2
    model, opt = _setup(world, which, z3, T, hsdp=hsdp)
    st = model._dmuon_state
    comm = dmuon.CommCounter()
    with comm:
        _steps(model, opt, range(STEPS), rank, world, T, comm)
    stats = comm.stats["step"]
    exchanged = [e for e in st.entries if e.is_matrix and not e.tp.local]
    return dict(
        params=full_params(model, st),
        ns_calls=opt.ns_calls,
        ns_blocks=opt.ns_blocks,
        local={e.name: tuple(e.param.shape) for e in st.entries if e.tp.local},
        owner={e.name: st.is_global_owner(e) for e in st.entries},
        step_calls={k: v for k, v in stats.calls.items() if v},
        p2p_bytes=stats.op_bytes["send"] + stats.op_bytes["recv_"],
        # the exchange's formula (tests/test_tensor_parallel.py) over the matrices exchanged
        formula=sum(
            2 * (math.prod(e.full_shape) - math.prod(e.tp.part_shape(e.tp.root))) * 4
            if e.tp.sharded
            else (T - 1) * math.prod(e.full_shape) * 4
            for e in exchanged
        ),
    )


def _expert_views(name: str):
    """The reference's blocks: each expert (gate_up: its gate and up rows apart)."""
    if name == "experts.gate_up":
        return lambda t: [w for x in t for w in (x[:FF], x[FF:])]
    return lambda t: list(t)


def _reference(muon: set[str], n: int = E, steps: int = STEPS) -> dict:
    model = MoE(n)
    views = {n: _expert_views(n) for n in muon if n.startswith("experts.")}
    loss = lambda m, step, r: m(*batch(step))  # noqa: E731
    return reference("", 1, steps, muon, HP, model=model, loss=loss, blocks=views)


@pytest.mark.parametrize("which,z3", [("all", True), ("experts", False)])
def test_experts_orthogonalized_where_they_lie(which, z3):
    _check_run(which, run_ranks(_train, 4, which, z3, False, timeout=600))


def test_experts_orthogonalized_where_they_lie_under_hsdp():
    """(replicate 2, shard 2, ep 2): the experts' owners publish them to the other replica."""
    _check_run("all", run_ranks(_train, 8, "all", True, True, timeout=600))


def _check_run(which, results):
    model = MoE()
    muon = {n for n, p in model.named_parameters() if PREDICATES[which](n, p)}
    ref = _reference(muon)
    for r in results:  # (1) parity with per-expert Muon, per parameter
        for n, want in ref.items():
            err = ((r["params"][n] - want).norm() / want.norm()).item()
            assert err < TOL, (which, n, err)
    # (2) every expert block orthogonalized exactly once per step in the job: the experts on
    # their owner slot's two expert ranks (2 + 1 experts), the other matrices once each
    blocks = {"experts.gate_up": 2 * E, "experts.down": E}
    want = STEPS * sum(blocks.get(n, 1) for n in muon)
    assert sum(r["ns_blocks"] for r in results) == want
    for n in blocks:  # the owner slot's expert ranks hold 2 and 1 experts: all E, once
        assert all(n in r["local"] for r in results)
        assert sorted(r["local"][n][0] for r in results if r["owner"][n]) == [1, 2]
    # (3) the step moves no bytes for the experts: its point-to-point bytes are the other
    # matrices' exchange alone (none when only the experts are dedicated)
    booked = sum(r["p2p_bytes"] for r in results) / STEPS
    assert booked == results[0]["formula"]
    if which == "experts":
        assert booked == 0
        for r in results:  # the global norm's all-reduce only
            assert r["step_calls"] == {"allreduce_": STEPS}, r["step_calls"]
    else:
        assert booked > 0  # the head (rows split) and the whole copies are exchanged


def _resume(rank, world, path):
    """Two steps on (dp 2, ep 2) and a checkpoint, loaded on (4, 1) and (2, 2): two steps more."""
    model, opt = _setup(world, "all", True)
    _steps(model, opt, range(2), rank, world)
    dmuon.save_checkpoint(path, model, opt)
    out = {}
    for T in (1, 2):
        model, opt = _setup(world, "all", True, T)
        dmuon.load_checkpoint(path, model, opt)
        _steps(model, opt, range(2, STEPS), rank, world, T)
        out[T] = full_params(model, model._dmuon_state)
    return out


def test_a_checkpoint_reshards_the_experts_across_expert_ranks(tmp_path):
    results = run_ranks(_resume, 4, str(tmp_path / "ckpt"), timeout=600)
    ref = _reference({n for n, p in MoE().named_parameters() if p.ndim >= 2})
    for r in results:
        for T, params in r.items():
            for n, want in ref.items():
                err = ((params[n] - want).norm() / want.norm()).item()
                assert err < TOL, (T, n, err)


def _one_expert(rank, world):
    """One expert over (dp 1, ep 2): expert rank 1 holds none."""
    model, opt = _setup(world, "all", True, n=1)
    _steps(model, opt, range(2), rank, world)
    st = model._dmuon_state
    held = {e.name: tuple(e.param.shape) for e in st.entries if e.tp.local}
    return dict(params=full_params(model, st), held=held, ns_blocks=opt.ns_blocks)


def test_an_expert_rank_without_experts_steps_the_others():
    results = run_ranks(_one_expert, 2)
    assert [r["held"]["experts.down"][0] for r in results] == [1, 0]
    ref = _reference({n for n, p in MoE(1).named_parameters() if p.ndim >= 2}, n=1, steps=2)
    for r in results:
        for n, want in ref.items():
            err = ((r["params"][n] - want).norm() / want.norm()).item()
            assert err < TOL, (n, err)
    # each step: gate_up's 2 blocks, down, and the 3 other matrices once each in the job
    assert sum(r["ns_blocks"] for r in results) == 2 * (2 + 1 + 3)


def _refused(rank, world):
    """dedicate_params on (dp 1, ep 2) for parameters TP splits and the blocks of which are not
    whole on each rank: the message of each."""
    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "ep"))
    out = {}
    cases = {
        "experts Shard(1)": (1, None),  # experts sharded along their rows
        "head rows/2": (0, {"head.weight": "rows/2"}),  # a row-split matrix read as 2 blocks
    }
    for what, (dim, blocks) in cases.items():
        model = parallelize(MoE(), mesh["ep"], experts_dim=dim)
        try:
            dmuon.dedicate_params(model, mesh["dp"], _matrices, blocks={**BLOCKS, **(blocks or {})})
        except ValueError as e:
            out[what] = str(e)
    return out


def test_other_split_multi_block_parameters_are_refused():
    for r in run_ranks(_refused, 2):
        assert r.keys() == {"experts Shard(1)", "head rows/2"}, r
        assert "experts.gate_up is made of several matrices" in r["experts Shard(1)"]
        assert "head.weight is made of several matrices" in r["head rows/2"]
        for msg in r.values():
            assert "Shard over a batch dim" in msg and "'flatten'" in msg


def test_the_plan_runs_experts_on_every_tensor_rank():
    shapes = {"experts.w": (6, 32, 16), "a": (32, 32), "b": (16, 64), "n": (8,)}
    layouts = {"experts.w": "Shard(0)", "a": "plain", "b": "Shard(0)", "n": "plain"}
    kw = dict(elementwise=["n"], tensor_size=2)
    plan = dmuon.partition(shapes, 1, layouts=layouts, **kw)
    assert plan.tensor_slot("experts.w") == LOCAL
    assert {plan.tensor_slot("a"), plan.tensor_slot("b")} == {0, 1}  # LPT over the rest
    s = dmuon.plan_summary(plan)
    (row,) = s.slots
    f = dict(zip(plan.names, plan.ns_flops, strict=True))
    per_rank = {plan.tensor_slot(n): f[n] + f["experts.w"] / 2 for n in ("a", "b")}
    assert row.tensor_ns_flops == pytest.approx([per_rank[0], per_rank[1]], rel=1e-12)
    # the largest one rank runs of the experts: half of them
    assert s.largest_ns_flops == max(f["a"], f["b"], f["experts.w"] / 2)
    # uneven: 3 experts over 2 ranks, 2 + 1; a Shard not over the batch runs on one rank
    shapes["experts.w"] = (3, 32, 16)
    uneven = dmuon.partition(shapes, 1, layouts=layouts, **kw)
    f = dict(zip(uneven.names, uneven.ns_flops, strict=True))
    loads = dmuon.plan_summary(uneven).slots[0].tensor_ns_flops
    per_rank = {uneven.tensor_slot(n): f[n] for n in ("a", "b")}
    want = [per_rank[0] + f["experts.w"] * 2 / 3, per_rank[1] + f["experts.w"] / 3]
    assert loads == pytest.approx(want, rel=1e-12)
    for other in ("Shard(1)", "Shard(2)", "plain"):
        lays = {**layouts, "experts.w": other}
        assert dmuon.partition(shapes, 1, layouts=lays, **kw).tensor_slot("experts.w") in (0, 1)
    # the other matrices' tensor slots are the plan's without the experts (their LPT unchanged;
    # plans without experts keep their digests: tests/test_plan_digests.py)
    rest = {n: s for n, s in shapes.items() if n != "experts.w"}
    alone = dmuon.partition(rest, 1, layouts={n: layouts[n] for n in rest}, **kw)
    assert all(alone.tensor_slot(n) == uneven.tensor_slot(n) for n in rest)
