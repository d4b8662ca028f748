"""Dedicated Muon on FSDP2 + TP and HSDP + TP meshes against a single-process reference.

The model (tests/_tp.py) splits block 0 and the head over the tensor ranks (Shard(0) and
Shard(1) matrices, an uneven head, Replicate() and Shard(0) biases) and leaves block 1
replicated. Tolerance: as tests/test_distributed.py (1e-4 relative per parameter after five
steps): tensor parallelism adds only other summation orders (a row-wise layer's partial products
summed across tensor ranks), fp32 rounding amplified by Newton-Schulz and Adam.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import dmuon_fn as dmuon
from tests import _tp
from tests._dist import run_ranks
from tests._models import HP, muon_fp32, reference

STEPS = 5
TOL = 1e-4


def _mesh(shape):
    if len(shape) == 2:
        m = init_device_mesh("cpu", shape, mesh_dim_names=("dp", "tp"))
        return m, m["dp"], None, m["dp"]
    m = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard", "tp"))
    return m, m["shard"], m["replicate"], m["replicate", "shard"]


def _train(rank, world, shape, z3, pure, async_=True):
    mesh, shard, rep, data = _mesh(shape)
    T = shape[-1]
    model = _tp.parallelize(_tp.TPModel(), mesh["tp"])
    dmuon.dedicate_params(
        model,
        shard,
        None if pure else _tp.is_matrix,
        replicate_mesh=rep,
        reshard_after_forward=z3,
        pure=pure,
    )
    if not pure:
        fully_shard(model, mesh=data)
    opt = muon_fp32(model, replicate_async=async_)
    st = model._dmuon_state
    data_rank = rank // T
    comm = dmuon.CommCounter()
    with comm:
        for step in range(STEPS):
            opt.zero_grad()
            with comm.phase("forward"):
                loss = model(_tp.tokens(step, data_rank))
            with comm.phase("backward"):
                loss.backward()
            with comm.phase("step"):
                opt.step()
            if step == 0:
                norm0 = float(opt.grad_norm)
    opt.wait_publish()
    split = [e for e in st.entries if e.is_matrix and e.tp.sharded]
    whole = [e for e in st.entries if e.is_matrix and not e.tp.sharded]
    step = comm.stats["step"]
    return dict(
        params=_tp.full_params(model, st),
        ns_calls=opt.ns_calls,
        n_matrices=sum(e.is_matrix for e in st.entries),
        step_calls={k: v for k, v in step.calls.items() if v},
        p2p_bytes=step.op_bytes["send"] + step.op_bytes["recv_"],
        # per step, the whole job: the other tensor ranks' parts of u in and of O out per split
        # matrix ((T-1)/T of it when even), T-1 copies of O per whole one (fp32)
        formula=sum(
            2 * (math.prod(e.full_shape) - math.prod(e.tp.part_shape(e.tp.root))) * 4
            for e in split
        )
        + sum((T - 1) * math.prod(e.full_shape) * 4 for e in whole),
        norm0=norm0,
        layouts=sorted({(e.name, e.tp.dim, e.tp.placements is not None) for e in st.entries}),
    )


def _first_norm(world):
    """The first step's global gradient norm, single-process."""
    model = _tp.TPModel()
    (sum(model(_tp.tokens(0, r)) for r in range(world)) / world).backward()
    return torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))


def _reference(world, pure):
    model = _tp.TPModel()
    muon = {n for n, p in model.named_parameters() if (p.ndim >= 2 if pure else _tp.is_matrix(n, p))}
    loss = lambda m, step, r: m(_tp.tokens(step, r))  # noqa: E731
    return reference("", world, STEPS, muon, HP, model=model, loss=loss)


def _check(shape, results, pure):
    data_ranks = math.prod(shape[:-1])
    ref = _reference(data_ranks, pure)
    for r in results:
        for n, want in ref.items():
            got = r["params"][n]
            err = ((got - want).norm() / want.norm()).item()
            assert err < TOL, (shape, pure, n, err)
    norm0 = _first_norm(data_ranks).item()
    for r in results:  # every value counted once: split parts, whole copies on one tensor rank
        assert r["norm0"] == pytest.approx(norm0, rel=1e-5), (r["norm0"], norm0)
    r0 = results[0]
    # each matrix orthogonalized exactly once per step in the whole job
    assert sum(r["ns_calls"] for r in results) == STEPS * r0["n_matrices"]
    # the step's traffic: the global norm and the TP exchange; under HSDP also the publish and
    # the gradients' second stage (across replicas), which the step's wait issues
    hsdp = {"broadcast_", "reduce_"} if len(shape) == 3 else set()
    allowed = {"allreduce_", "send", "recv_"} | hsdp
    for r in results:
        assert set(r["step_calls"]) <= allowed, r["step_calls"]
        assert r["step_calls"]["allreduce_"] == STEPS
    booked = sum(r["p2p_bytes"] for r in results) / STEPS
    assert booked == pytest.approx(r0["formula"]), (booked, r0["formula"])


def _run_all(rank, world, shape, cases):
    return [_train(rank, world, shape, *c) for c in cases]


CASES = [(True, False), (False, False), (True, True)]  # (z3, pure)


@pytest.mark.slow
def test_parity_data_2_tensor_2():
    shape = (2, 2)
    results = run_ranks(_run_all, 4, shape, CASES, timeout=600)
    for i, (_, pure) in enumerate(CASES):
        _check(shape, [r[i] for r in results], pure)


@pytest.mark.slow
def test_parity_replicate_2_shard_2_tensor_2():
    shape = (2, 2, 2)
    cases = [(True, False), (False, True)]
    results = run_ranks(_run_all, 8, shape, cases, timeout=600)
    for i, (_, pure) in enumerate(cases):
        _check(shape, [r[i] for r in results], pure)
