"""Newton-Schulz shared by a team (dmuon_fn.orthogonalize_team, proofs/team_ns.md): each member's
slice of the result equals that slice of one rank's `orthogonalize` of the whole matrix (fp32
iterates: to fp32 rounding; bf16: as close to the float64 polar factor as one rank's), on teams
of 2 and 4 gloo ranks, wide and tall, uneven slices, a batch, both forms; the collectives are
the formula's (one m×m Gram sum per standard step and per Gram start and restart: an fp32
all-reduce, or for bf16 iterates an fp32 reduce-scatter and a bf16 all-gather; one all-gather
of two scalars per member and matrix, and per standard step one of b·A + c·A²'s row blocks,
which the members share); compiled with fullgraph, one graph."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import dmuon_fn as dmuon
from dmuon_fn.ns._cost import default_restarts, team_bytes
from tests._dist import run_ranks
from tests._tolerance import rel_err

# (trailing shape, dim cut, leading batch); the cuts give members uneven widths
CASES = [((48, 200), -1, ()), ((200, 48), -2, ()), ((40, 160), -1, (2,)), ((96, 96), -1, ())]


def _whole(shape, batch, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*batch, *shape, generator=g)


def _bounds(n: int, members: int) -> list[int]:
    """Uneven cut points: member i gets about (i + 2) parts of the long side."""
    weights = [i + 2 for i in range(members)]
    cuts, acc = [0], 0
    for w in weights:
        acc += w
        cuts.append(round(n * acc / sum(weights)))
    return cuts


def _slice(W, dim, bounds, i):
    return W.narrow(dim, bounds[i], bounds[i + 1] - bounds[i])


def _team_run(rank, world, team, method, dtype, seed=0):
    """Every case (its matrix drawn from `seed`) on teams of `team` ranks (consecutive ranks),
    and what CommCounter booked."""
    groups = [dist.new_group(list(range(r, r + team))) for r in range(0, world, team)]
    group, member = groups[rank // team], rank % team
    out = []
    for shape, dim, batch in CASES:
        W = _whole(shape, batch, seed)
        bounds = _bounds(shape[dim], team)
        cfg = dmuon.NSConfig(method=method, dtype=dtype)
        with dmuon.CommCounter() as comm:
            mine = dmuon.orthogonalize_team(
                _slice(W, dim, bounds, member), group, shape, dim=dim, cfg=cfg
            )
        stats = comm.stats["other"]
        out.append((mine, dict(stats.calls), dict(stats.op_bytes)))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("team", [2, 4])
@pytest.mark.parametrize("method", ["standard", "gram"])
def test_each_member_holds_its_slice_of_the_whole_result_fp32(team, method):
    results = run_ranks(_team_run, 4, team, method, torch.float32)
    for k, (shape, dim, batch) in enumerate(CASES):
        W = _whole(shape, batch)
        whole = dmuon.orthogonalize(W, method=method, dtype=torch.float32)
        bounds = _bounds(shape[dim], team)
        m = min(shape)
        for rank, res in enumerate(results):
            mine, calls, booked = res[k]
            ref = _slice(whole, dim, bounds, rank % team)
            assert mine.shape == ref.shape and mine.dtype == W.dtype
            assert rel_err(mine, ref) < 1e-5, (shape, dim, rank, rel_err(mine, ref))
            # the formula: m×m fp32 all-reduces, one per standard step / Gram (re)start; one
            # all-gather of two float64 per member and matrix, and per standard step one of
            # b·A + c·A²'s row blocks (⌈m/k⌉ rows each)
            nb = batch[0] if batch else 1
            reduces = 5 if method == "standard" else 1 + len(default_restarts(5))
            squares = 5 if method == "standard" else 0
            assert calls == {"all_gather_into_tensor": 1 + squares, "all_reduce": reduces}
            share = (team - 1) / team
            assert booked["all_reduce"] == pytest.approx(reduces * 2 * share * 4 * m * m * nb)
            gathered = team * 16 * nb + squares * team * -(-m // team) * m * 4 * nb
            assert booked["all_gather_into_tensor"] == pytest.approx(share * gathered)
            # the planner's count of the same (ns/_cost.py), per matrix of the batch
            per = team_bytes(shape, team, method=method, itemsize=4)
            assert sum(booked.values()) == pytest.approx(nb * per)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["standard", "gram"])
def test_bf16_team_is_as_close_to_the_polar_factor_as_one_rank(method):
    """bf16 iterates: the Gram sums go as an fp32 reduce-scatter of row blocks and a bf16
    all-gather (one per standard step / Gram (re)start; counted against `team_bytes`)."""
    world = 4
    results = run_ranks(_team_run, world, world, method, torch.bfloat16, 1)
    for k, (shape, dim, batch) in enumerate(CASES):
        W = _whole(shape, batch, seed=1)
        joined = torch.cat([r[k][0] for r in results], dim=dim)
        one = dmuon.orthogonalize(W, dtype=torch.bfloat16, method=method)
        U, _, Vh = torch.linalg.svd(W.double(), full_matrices=False)
        polar = (U @ Vh).float()
        assert rel_err(joined, polar) < 1.1 * rel_err(one, polar) + 1e-3, shape
        nb, m = (batch[0] if batch else 1), min(shape)
        sums = 5 if method == "standard" else 1 + len(default_restarts(5))
        squares = 5 if method == "standard" else 0
        blocks = world * -(-m // world) * m * nb
        share = (world - 1) / world
        for _, calls, booked in (r[k] for r in results):
            assert calls == {
                "reduce_scatter_tensor": sums,
                "all_gather_into_tensor": 1 + sums + squares,
            }
            assert booked["reduce_scatter_tensor"] == pytest.approx(sums * share * 4 * blocks)
            per = team_bytes(shape, world, method=method, itemsize=2)
            assert sum(booked.values()) == pytest.approx(nb * per)


def _compiled(rank, world, method, dtype):
    from torch._dynamo.testing import CompileCounterWithBackend

    # bf16: 47 rows, so the Gram sum's reduce-scatter pads its last row block
    shape, dim = ((48, 200) if dtype == torch.float32 else (47, 200)), -1
    W = _whole(shape, ())
    bounds = _bounds(shape[dim], world)
    G = _slice(W, dim, bounds, rank).contiguous()
    cfg = dmuon.NSConfig(dtype=dtype, method=method)
    cnt = CompileCounterWithBackend("aot_eager")

    def fn(x):
        return dmuon.orthogonalize_team(x, dist.group.WORLD, shape, dim=dim, cfg=cfg)

    compiled = torch.compile(fn, backend=cnt, fullgraph=True)(G)
    return rel_err(compiled, fn(G)), cnt.frame_count


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("method", ["standard", "gram"])
def test_compiles_to_one_graph_with_the_eager_values(method, dtype):
    for err, frames in run_ranks(_compiled, 2, method, dtype):
        assert frames == 1 and err < 1e-6, (err, frames)


def _extreme_run(rank, world, scale):
    """A 24×64 matrix on a team of 2: member 0's columns all zero, member 1's of size `scale`."""
    W = _whole((24, 64), (), seed=3) * scale
    W[:, :32] = 0.0
    cfg = dmuon.NSConfig(dtype=torch.float32)
    part = W[:, 32 * rank : 32 * (rank + 1)]
    mine = dmuon.orthogonalize_team(part, dist.group.WORLD, (24, 64), cfg=cfg)
    return mine, W


@pytest.mark.slow
def test_a_zero_slice_and_huge_entries_normalize_as_the_whole():
    """Claim 1: each member scales by its own max, so entries near the fp32 maximum do not
    overflow the sum of squares, and a zero slice stays exact zeros."""
    for scale in (1e30, 3e-30):
        (zero, W), (other, _) = run_ranks(_extreme_run, 2, scale)
        whole = dmuon.orthogonalize(W, dtype=torch.float32)
        assert torch.equal(zero, torch.zeros_like(zero))
        assert torch.isfinite(other).all() and rel_err(other, whole[:, 32:]) < 1e-5


@pytest.mark.parametrize(
    "shape, dim, G, match",
    [
        ((48, 200), -1, torch.zeros(48, 0), "not part of"),
        ((48, 200), -1, torch.zeros(40, 50), "not part of"),
        ((48, 200), -2, torch.zeros(10, 200), "short side"),
        ((48, 200), 0, torch.zeros(48, 50), "dim -1 or -2"),
        ((48, 200), -1, torch.zeros(48, 50, dtype=torch.int32), "floating"),
    ],
)
def test_bad_slices_raise(shape, dim, G, match):
    with pytest.raises(ValueError, match=match):
        dmuon.orthogonalize_team(G, None, shape, dim=dim)
