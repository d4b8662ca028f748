"""Grouped, prefetched gathers and asynchronous reduces (dmuon_fn/dedicated/_schedule.py,
proofs/prefetch.md): the same results with prefetch on and off, one collective order on every
rank, accumulation without traffic, and what the exposed-communication timer counts.

The model runs its three blocks in an order that changes between steps (not the registration
order; a block skipped; a block run twice), so the recorded order is right, wrong, and right
again. Results with prefetch 0 (every gather and reduce when needed, blocking), 1 and 2 are
equal bit for bit (the same collectives carry the same bytes; only when they are issued and
waited for moves), and equal a single-process run of the same math to fp32 rounding (1e-4, as
tests/test_distributed.py).
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch._dynamo.testing import CompileCounterWithBackend

import custom_ops._collectives as collectives
import dmuon_fn as dmuon
from tests._dist import run_ranks
from tests._models import HP, Block, D, full_params, meshes, muon_fp32, reference

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "benchmarks"))
from _memory import peak_bytes

# per step: the blocks' order (registration order is 0, 1, 2)
ORDERS = [(2, 0, 1), (2, 0, 1), (2, 1), (2, 0, 0, 1), (2, 0, 1), (1, 2, 0)]
TOL = 1e-4


class Chain(nn.Module):
    """Three transformer blocks, run in the order the caller gives."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(Block(D) for _ in range(3))

    def forward(self, x: torch.Tensor, order) -> torch.Tensor:
        for i in order:
            x = self.blocks[i](x)
        return x.square().mean()


def _x(step: int, rank: int, micro: int = 0) -> torch.Tensor:
    return torch.randn(
        2, 8, D, generator=torch.Generator().manual_seed(97 * step + 7 * micro + rank)
    )


@contextlib.contextmanager
def collective_log():
    """The collectives this rank issues through torch.distributed, in issue order: (group's
    ranks, function, dtype, numel). Python-level, so compiled blocks' ops (which run dmuon_fn's
    Python at run time) are seen too, where a dispatch mode would disable torch.compile. A
    reduce made of direct transfers (`SendReduce`: the owner receives, the others send) logs
    as one reduce on every rank of its group."""
    calls: list[tuple[tuple[int, ...], str, str, int]] = []
    names = ("broadcast", "reduce", "all_reduce", "isend", "irecv")
    saved = {n: getattr(dist, n) for n in names}
    send_init = collectives.SendReduce.__init__
    inside = []

    def ranks(group):
        return tuple(
            range(dist.get_world_size()) if group is None else dist.get_process_group_ranks(group)
        )

    def logged(name, fn):
        def run(tensor, *args, group=None, **kwargs):
            if not inside:
                calls.append((ranks(group), name, str(tensor.dtype), tensor.numel()))
            return fn(tensor, *args, group=group, **kwargs)

        return run

    def send_reduce(self, t, dst, pg):
        calls.append((ranks(pg), "reduce", str(t.dtype), t.numel()))
        inside.append(True)
        try:
            send_init(self, t, dst, pg)
        finally:
            inside.pop()

    for n, fn in saved.items():
        setattr(dist, n, logged(n, fn))
    collectives.SendReduce.__init__ = send_reduce
    try:
        yield calls
    finally:
        for n, fn in saved.items():
            setattr(dist, n, fn)
        collectives.SendReduce.__init__ = send_init


def _chain(world, hsdp, z3, depth, compile_blocks=False):
    """depth: the prefetch depth, or "N+step": depth N with Muon(gather_in_step=True)."""
    in_step = isinstance(depth, str)
    depth = int(depth.split("+")[0]) if in_step else depth
    mesh, rep = meshes(world, hsdp)
    model = Chain()
    dmuon.dedicate_params(
        model, mesh, pure=True, replicate_mesh=rep, reshard_after_forward=z3, prefetch=depth
    )
    cnt = None
    if compile_blocks:
        cnt = CompileCounterWithBackend("aot_eager")
        for i, block in enumerate(model.blocks):
            model.blocks.register_module(str(i), torch.compile(block, backend=cnt, fullgraph=True))
    return model, muon_fp32(model, gather_in_step=in_step), cnt


def _orders(rank, world, hsdp, z3, depth, compile_blocks):
    model, opt, cnt = _chain(world, hsdp, z3, depth, compile_blocks)
    with collective_log() as log:
        for step, order in enumerate(ORDERS):
            opt.zero_grad()
            model(_x(step, rank), order).backward()
            opt.step()
    opt.wait_publish()
    frames = None if cnt is None else cnt.frame_count
    params = {n.replace("_orig_mod.", ""): p for n, p in _params(model).items()}
    return dict(params=params, log=log, frames=frames)


def _params(model):
    return full_params(model, model._dmuon_state)


def _assert_one_order_per_group(logs, what):
    """On every group, each member rank issued the same collectives in the same order."""
    groups = {call[0] for log in logs for call in log}
    assert groups, "no collective was logged"
    for ranks in groups:
        seqs = [[c[1:] for c in logs[r] if c[0] == ranks] for r in ranks]
        assert all(seq == seqs[0] for seq in seqs), f"group {ranks} out of order ({what})"


def _all_depths(rank, world, hsdp, z3, compile_blocks, depths):
    return {d: _orders(rank, world, hsdp, z3, d, compile_blocks) for d in depths}


def _reference(world):
    return _reference_of(world)(HP)


def _reference_of(world):
    """(hp, **knobs) -> tests._models.reference of this test's model, orders and batches."""

    def ref(hp, **wrong):
        model = Chain()
        muon = {n for n, p in model.named_parameters() if p.ndim >= 2}
        return reference(
            "chain",
            world,
            len(ORDERS),
            muon,
            hp,
            model=model,
            loss=lambda m, step, rank: m(_x(step, rank), ORDERS[step]),
            **wrong,
        )

    return ref


CASES = [
    # world, hsdp, z3, compiled blocks, depths
    pytest.param(2, False, True, False, (0, 1, 2, "1+step", "2+step"), id="w2-z3"),
    pytest.param(2, False, False, False, (0, 1, 2, "1+step"), id="w2-z2"),
    pytest.param(2, False, True, True, (0, 1, "1+step"), id="w2-z3-compiled"),
    pytest.param(4, False, True, False, (0, 1, "1+step"), id="w4-z3"),
    pytest.param(4, False, False, False, (0, "1+step"), id="w4-z2"),
    pytest.param(4, True, True, False, (0, 1), id="hsdp2x2-z3"),
    pytest.param(4, True, False, False, (0, 1), id="hsdp2x2-z2"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("world", "hsdp", "z3", "compiled", "depths"), CASES)
def test_prefetch_on_and_off_agree_bitwise_and_ranks_issue_one_order(
    world, hsdp, z3, compiled, depths
):
    results = run_ranks(_all_depths, world, hsdp, z3, compiled, depths, timeout=600)
    ref = _reference(world)
    for d in depths:
        _assert_one_order_per_group([r[d]["log"] for r in results], d)
        for r in results:
            for n, p in r[d]["params"].items():
                assert torch.equal(p, r[depths[0]]["params"][n]), (d, n)  # as prefetch off
                err = ((p - ref[n]).norm() / ref[n].norm()).item()
                assert err < TOL, (d, n, err)
            if compiled:
                assert r[d]["frames"] == r[0]["frames"], "prefetch adds no recompile"


def _accumulate(rank, world, micro, sync_each):
    """One step over `micro` micro-batches (loss / micro each): gradient sync off for all but
    the last (or on for every one), counting the dedicated reduce traffic."""
    model, opt, _ = _chain(world, False, True, 1)
    comm = dmuon.CommCounter()
    with comm, comm.phase("backward"):
        for step in range(2):
            opt.zero_grad()
            for m in range(micro):
                last = m == micro - 1
                dmuon.set_requires_gradient_sync(model, sync_each or last)
                (model(_x(step, rank, m), ORDERS[0]) / micro).backward()
            opt.step()
    opt.wait_publish()
    bytes_ = comm.stats["backward"].op_bytes["reduce_"]
    calls = comm.stats["backward"].calls["reduce_"]
    return _params(model), bytes_, calls


def test_accumulation_without_traffic_equals_one_big_batch():
    micro, world = 4, 2
    deferred = run_ranks(_accumulate, world, micro, False)
    each = run_ranks(_accumulate, world, micro, True)
    model = Chain()
    muon = {n for n, p in model.named_parameters() if p.ndim >= 2}

    def big_batch(m, step, rank):  # the mean over the micro-batches of one rank
        return sum(m(_x(step, rank, k), ORDERS[0]) for k in range(micro)) / micro

    ref = reference("chain", world, 2, muon, HP, model=model, loss=big_batch)
    for (params, b_def, c_def), (params_each, b_each, c_each) in zip(deferred, each, strict=True):
        for n, p in params.items():
            assert ((p - ref[n]).norm() / ref[n].norm()).item() < 1e-5, n
            assert ((p - params_each[n]).norm() / p.norm()).item() < 1e-5, n
        assert b_def > 0 and b_def * micro == b_each, (b_def, b_each)
        assert c_def * micro == c_each


def _timer(rank, world, depth):
    model, opt, _ = _chain(world, False, True, depth)
    st = model._dmuon_state
    with dmuon.CommTimer() as timer:
        for step in range(2):
            opt.zero_grad()
            with timer.phase("forward"):
                loss = model(_x(step, rank), ORDERS[0])
            with timer.phase("backward"):
                loss.backward()
            with timer.phase("step"):
                opt.step()
    groups = sum(len(u.groups) for u in st.scheduler.units)
    kept = len(st.scheduler.order[-1].groups)  # the last unit's copy serves backward
    return dict(timer.waits), dict(timer.seconds), groups, kept, len(st.scheduler.buckets)


@pytest.mark.slow
def test_comm_timer_counts_every_blocking_wait():
    """Prefetch off: every unit group's gather (forward) and re-gather (Z3 backward: all but the
    last unit's, whose copy backward keeps) and every module bucket's reduce is waited for where
    it is issued, each wait counted once, in its phase."""
    for waits, seconds, groups, kept, buckets in run_ranks(_timer, 2, 0):
        assert waits["forward"] == 2 * groups  # two steps, every unit once
        assert 0 < kept < groups
        assert waits["backward"] == 2 * (groups - kept + buckets)  # re-gathers and reduces
        assert all(s >= 0.0 for s in seconds.values()) and seconds["forward"] > 0.0


def _peaks(rank, world, depth):
    """The chain under Z3 at prefetch `depth`, once its order is recorded: the peak bytes of
    gathered parameters over a whole step, then in one forward and, separately, its backward
    (each direction's prefetch seen on its own), the largest unit's bytes, and what the forward
    leaves the backward: (the last unit's copy kept, the units issued ahead)."""
    model, opt, _ = _chain(world, False, True, depth)

    def step(i):
        opt.zero_grad()
        model(_x(i, rank), ORDERS[0]).backward()

    step(0)
    opt.step()  # the recorded order exists from here
    _, whole = peak_bytes(lambda: step(1))
    opt.zero_grad()
    loss, forward = peak_bytes(lambda: model(_x(2, rank), ORDERS[0]))
    sched = model._dmuon_state.scheduler
    left = (id(sched.order[-1]) in sched.landed, len(sched.backward.ahead))
    _, backward = peak_bytes(loss.backward)
    unit = max(sum(g.numel * 4 for g in u.groups) for u in sched.units)
    return whole["gathered"], forward["gathered"], backward["gathered"], unit, left


@pytest.mark.slow
def test_z3_holds_at_most_depth_plus_one_units():
    """At most the running unit and `depth` prefetched ones are held at once, over a step and
    in its forward and its backward each, and the prefetch really happens: the step's and the
    forward's peaks exceed `depth` units (ORDERS[0] runs all three blocks, of equal units, so
    depth 2 holds all three). The backward begins with the last unit's copy, which the forward
    keeps for it, and the `depth` units before it already issued (so the backward itself
    allocates at most one unit more). Without prefetch the forward peaks at one unit."""
    for depth in (0, 1, 2):
        for gathered, forward, backward, unit, left in run_ranks(_peaks, 2, depth):
            assert depth * unit < gathered <= (depth + 1) * unit, (depth, gathered, unit)
            assert depth * unit < forward <= (depth + 1) * unit, (depth, forward, unit)
            assert left == (True, depth), left
            assert backward <= min(1, 2 - depth) * unit, (depth, backward, unit)


def _block_graph(rank, world):
    """A compiled block's Dynamo graph (Z2, prefetch on) as op names in order."""
    model, opt, _ = _chain(world, False, False, 1)
    graphs = []

    def record(gm, example_inputs):
        graphs.append([str(n.target) for n in gm.graph.nodes if n.op == "call_function"])
        return gm.forward

    model.blocks[0] = torch.compile(model.blocks[0], backend=record, fullgraph=True)
    model(_x(0, rank), ORDERS[0]).backward()
    opt.step()
    (ops,) = graphs
    return ops


@pytest.mark.slow
def test_compiled_block_issues_its_gathers_before_it_computes():
    """The graph starts the whole block's gathers (dmuon::gather_start) before its first
    matmul; each projection waits for its own (dmuon::param_gather) right before its use, so
    the later ones wait after the earlier ones computed."""
    for ops in run_ranks(_block_graph, 2):
        starts = [i for i, o in enumerate(ops) if "gather_start" in o]
        gathers = [i for i, o in enumerate(ops) if "param_gather" in o]
        linears = [i for i, o in enumerate(ops) if "linear" in o]
        assert starts and linears and len(gathers) == 12, ops  # pure: 6 weights, 2 biases, 2 norms
        assert starts[0] < linears[0] < gathers[-1], (starts, linears, gathers)
