"""The reduce behind every dedicated gradient (custom_ops._collectives.reduce_start): over a
small gloo group, direct transfers to the owner instead of gloo's reduce (over two ranks the same
result bits), the same booking in CommCounter, and the pairing kept when several are in flight
with different owners (proofs/prefetch.md claim 8)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import custom_ops._collectives as collectives
import dmuon_fn as dmuon
from custom_ops._collectives import SendReduce, reduce_start
from tests._dist import run_ranks

DTYPES = (torch.float32, torch.bfloat16, torch.float64)


def _values(rank: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * k + rank)
    return (torch.randn(1000 + 37 * k, generator=g) * 10 ** (k % 5)).to(dtype)


def _in_flight(rank, world):
    """Reduces in flight at once over the world, owners taking turns, against gloo's reduce of
    the same values; what CommCounter books for each. Groups past two ranks take the direct
    transfers only where SEND_REDUCE_MAX allows (custom_ops/_collectives.py: held at two)."""
    collectives.SEND_REDUCE_MAX = world
    out = {}
    for dtype in DTYPES:
        mine = [_values(rank, k, dtype) for k in range(6)]
        comm = dmuon.CommCounter()
        with comm:
            bufs = [t.clone() for t in mine]
            works = [reduce_start(b, k % world, dist.group.WORLD) for k, b in enumerate(bufs)]
            kinds = {type(w) for w in works}
            for w in reversed(works):  # waited for in any order
                w.wait()
        with dmuon.CommCounter() as ref_comm:
            refs = [t.clone() for t in mine]
            for k, r in enumerate(refs):
                dist.reduce(r, dst=k % world, op=dist.ReduceOp.SUM)
        out[dtype] = dict(
            mine=[
                (b, r) for k, (b, r) in enumerate(zip(bufs, refs, strict=True)) if k % world == rank
            ],
            kinds=kinds,
            booked=dict(comm.stats["other"].op_bytes),
            calls=dict(comm.stats["other"].calls),
            ref_booked=dict(ref_comm.stats["other"].op_bytes),
        )
    return out


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_send_reduce_equals_gloo_reduce_and_books_as_one(world):
    """Over two ranks the same bits as gloo's reduce; over four the same sum to rounding (its
    own fixed order); per rank, in CommCounter, exactly what the reduce it replaces books."""
    for rank, res in enumerate(run_ranks(_in_flight, world)):
        for dtype, r in res.items():
            assert r["kinds"] == {SendReduce}, (rank, dtype)
            assert r["mine"], (rank, dtype)
            for b, ref in r["mine"]:
                if world == 2:
                    assert torch.equal(b, ref), (rank, dtype)
                else:
                    tol = 1e-2 if dtype == torch.bfloat16 else 1e-6
                    torch.testing.assert_close(b, ref, rtol=tol, atol=tol * ref.abs().max())
            # per rank: (W-1)/W of each payload, as dist.reduce's booking, one call per reduce
            assert r["booked"].keys() == r["ref_booked"].keys() == {"reduce_"}, (rank, dtype)
            assert r["booked"]["reduce_"] == pytest.approx(r["ref_booked"]["reduce_"])
            assert r["calls"] == {"reduce_": 6}, (rank, dtype)


def _subgroups(rank, world):
    """Two groups of two inside a world of four (HSDP's replicate pairs): each pair's transfers
    stay in it; the four-rank group's reduce is direct transfers too, and a group past
    SEND_REDUCE_MAX (patched to 4, then 3) runs gloo's reduce."""
    pairs = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    pg = pairs[rank % 2]
    t = torch.full((64,), float(rank + 1))
    owner = 1  # group rank 1: global rank 2 or 3
    work = reduce_start(t, owner, pg)
    work.wait()
    full = torch.full((8,), float(rank + 1))
    collectives.SEND_REDUCE_MAX = 4
    world_work = reduce_start(full, 3, dist.group.WORLD)
    world_work.wait()
    collectives.SEND_REDUCE_MAX, gloo = 3, full.clone()
    gloo_work = reduce_start(gloo, 3, dist.group.WORLD)
    gloo_work.wait()
    with dmuon.CommCounter() as comm:  # a pair's collectives book (2-1)/2, not (4-1)/4
        dist.broadcast(t.clone(), src=dist.get_global_rank(pg, 0), group=pg)
        dist.all_reduce(t.clone(), group=pg)
        dist.broadcast(full.clone(), src=0)
    return dict(
        booked=dict(comm.stats["other"].op_bytes),
        send_kind=type(work).__name__,
        world_kind=type(world_work).__name__,
        gloo_kind=type(gloo_work).__name__,
        sum=t[0].item() if dist.get_rank(pg) == owner else None,
        world_sum=full[0].item() if rank == 3 else None,
    )


@pytest.mark.slow
def test_send_reduce_stays_in_its_group_and_larger_groups_use_gloo_reduce():
    res = run_ranks(_subgroups, 4)
    assert {r["send_kind"] for r in res} == {r["world_kind"] for r in res} == {"SendReduce"}
    assert "SendReduce" not in {r["gloo_kind"] for r in res}
    assert res[2]["sum"] == 1 + 3 and res[3]["sum"] == 2 + 4
    assert res[3]["world_sum"] == 1 + 2 + 3 + 4
    for r in res:
        assert r["booked"] == {"broadcast_": 256 / 2 + 32 * 3 / 4, "allreduce_": 2 * 256 / 2}
