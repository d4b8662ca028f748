"""Dedicated Muon on FSDP2 + TP and HSDP + TP meshes against a single-process reference
(proofs/tensor_parallel.md).

The model (tests/_tp.py) splits block 0 and the head over the tensor ranks (Shard(0) and
Shard(1) matrices, an uneven head, Replicate() and Shard(0) biases) and leaves block 1
replicated. Tolerance: as tests/test_distributed.py (1e-4 relative per parameter after five
steps): tensor parallelism adds only other summation orders (a row-wise layer's partial products
summed across tensor ranks), fp32 rounding amplified by Newton-Schulz and Adam.

Per run: the parameters against the reference, Newton-Schulz runs over the job, the first
step's gradient norm (each value counted once), the step's collectives and its exchange bytes
against their formula, and Z3's re-gathers. Also: checkpoints across tensor-parallel degrees,
blocks compiled alone (no graph break), a matrix with an empty part, bf16 compute.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
from torch._dynamo.utils import counters
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

import dmuon_fn as dmuon
from tests import _oracle as oracle
from tests import _tp
from tests._dist import run_ranks
from tests._models import HP, full_params, muon_fp32, reference
from tests._tolerance import rel_err

STEPS = 5
TOL = 1e-4


def _mesh(shape):
    if len(shape) == 2:
        m = init_device_mesh("cpu", shape, mesh_dim_names=("dp", "tp"))
        return m, m["dp"], None, m["dp"]
    m = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard", "tp"))
    return m, m["shard"], m["replicate"], m["replicate", "shard"]


def _setup(shape, z3, pure, async_=True, compile_blocks=False, gather_in_step=False):
    """The TP model prepared on a mesh of `shape` ((dp, tp) or (replicate, shard, tp));
    compile_blocks: each block compiled alone (aot_eager, fullgraph) before fully_shard."""
    mesh, shard, rep, data = _mesh(shape)
    model = _tp.parallelize(_tp.TPModel(), mesh["tp"])
    dmuon.dedicate_params(
        model,
        shard,
        None if pure else _tp.is_matrix,
        replicate_mesh=rep,
        reshard_after_forward=z3,
        pure=pure,
    )
    if compile_blocks:
        for i, block in enumerate(model.layers):
            compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
            model.layers.register_module(str(i), compiled)
    if not pure:
        fully_shard(model, mesh=data)
    extra = {"gather_in_step": True} if gather_in_step else {}
    return model, muon_fp32(model, replicate_async=async_, **extra)


def _train(rank, world, shape, z3, pure, gather_in_step=False):
    T = shape[-1]
    model, opt = _setup(shape, z3, pure, gather_in_step=gather_in_step)
    st = model._dmuon_state
    data_rank, data_size = rank // T, world // T
    comm = dmuon.CommCounter()
    with comm:
        for step in range(STEPS):
            opt.zero_grad()
            with comm.phase("forward"):
                loss = model(_tp.tokens(step, data_rank, data_size))
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
        params=full_params(model, st),
        ns_calls=opt.ns_calls,
        n_matrices=sum(e.is_matrix for e in st.entries),
        step_calls={k: v for k, v in step.calls.items() if v},
        p2p_bytes=step.op_bytes["send"] + step.op_bytes["recv_"],
        # per step, the whole job: the other tensor ranks' parts of u in and of O out per split
        # matrix ((T-1)/T of it when even), T-1 copies of O per whole one (fp32)
        formula=sum(
            2 * (math.prod(e.full_shape) - math.prod(e.tp.part_shape(e.tp.root))) * 4 for e in split
        )
        + sum((T - 1) * math.prod(e.full_shape) * 4 for e in whole),
        norm0=norm0,
        # dmuon_fn's gathers (FSDP2 all-gathers; the publish runs in the step)
        gathered={ph: comm.stats[ph].op_bytes["broadcast_"] for ph in ("forward", "backward")},
        # each recorded unit's gather, as CommCounter books broadcasts over the shard group
        unit_bytes=[_gather_bytes(st, u) for u in st.scheduler.order],
        # the layouts the run covered: (split dim or None, computed with as a DTensor)
        layouts={(e.tp.dim, e.tp.placements is not None) for e in st.entries},
    )


def _gather_bytes(st, unit) -> float:
    """The bytes CommCounter books for one gather of `unit` (broadcasts over the shard group)."""
    w = st.shard_size
    held = sum(g.numel * torch.empty((), dtype=g.dtype).element_size() for g in unit.groups)
    return (w - 1) / w * held if w > 1 else 0.0


def _first_norm():
    """The first step's global gradient norm, single-process."""
    model = _tp.TPModel()
    model(_tp.tokens(0)).backward()
    return torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))


def _reference(pure):
    """Five steps on the global batches, single-process (one data rank: the same mean loss)."""
    return _reference_of(pure)(HP)


def _reference_of(pure):
    """(hp, **knobs) -> `_reference`'s run with those hyperparameters and reference knobs."""

    def ref(hp, **wrong):
        model = _tp.TPModel()
        muon = {
            n for n, p in model.named_parameters() if (p.ndim >= 2 if pure else _tp.is_matrix(n, p))
        }
        loss = lambda m, step, r: m(_tp.tokens(step))  # noqa: E731
        return reference("", 1, STEPS, muon, hp, model=model, loss=loss, **wrong)

    return ref


def _close(ref, runs, what) -> None:
    for params in runs:
        for n, want in ref.items():
            err = ((params[n] - want).norm() / want.norm()).item()
            assert err < TOL, (what, n, err)


def _check(shape, results, z3, pure, gather_in_step=False):
    _close(_reference(pure), [r["params"] for r in results], (shape, pure))
    norm0 = _first_norm().item()
    for r in results:  # every value counted once: split parts, whole copies on one tensor rank
        assert r["norm0"] == pytest.approx(norm0, rel=1e-5), (r["norm0"], norm0)
    for r in results:  # every unit gathered once per forward (TP parts too); Z3 again for
        # backward but the last unit, whose copy the backward keeps (the units before it are
        # issued as the forward ends, so some of the backward's gathers count in "forward")
        once = STEPS * sum(r["unit_bytes"])
        again = once - STEPS * r["unit_bytes"][-1] if z3 else 0
        got = r["gathered"]
        if not gather_in_step:  # (else the step issues some of the forward's gathers)
            assert got["forward"] + got["backward"] == pytest.approx(once + again), got
            assert once <= got["forward"] <= once + again and (z3 or got["backward"] == 0), got
    r0 = results[0]
    # row- and column-wise shards, plain whole copies; with pure also the Replicate() bias
    covered = {(0, True), (1, True), (None, False)} | ({(None, True)} if pure else set())
    assert r0["layouts"] == covered, r0["layouts"]
    # each matrix orthogonalized exactly once per step in the whole job
    assert sum(r["ns_calls"] for r in results) == STEPS * r0["n_matrices"]
    # the step's traffic: the global norm and the TP exchange; under HSDP also the publish and
    # the gradients' second stage (across replicas), which the step's wait issues; with
    # gather_in_step the next forward's gathers
    hsdp = {"broadcast_", "reduce_"} if len(shape) == 3 else set()
    allowed = {"allreduce_", "send", "recv_"} | hsdp | ({"broadcast_"} if gather_in_step else set())
    for r in results:
        assert set(r["step_calls"]) <= allowed, r["step_calls"]
        assert r["step_calls"]["allreduce_"] == STEPS
    booked = sum(r["p2p_bytes"] for r in results) / STEPS
    assert booked == pytest.approx(r0["formula"]), (booked, r0["formula"])


def _run_all(rank, world, shape, cases):
    return [_train(rank, world, shape, *c) for c in cases]


# (z3, pure[, gather_in_step])
CASES = [(True, False), (False, False), (True, True), (False, False, True), (True, False, True)]


@pytest.mark.slow
def test_parity_data_2_tensor_2():
    shape = (2, 2)
    results = run_ranks(_run_all, 4, shape, CASES, timeout=600)
    for i, case in enumerate(CASES):
        _check(shape, [r[i] for r in results], *case)


@pytest.mark.slow
def test_parity_replicate_2_shard_2_tensor_2():
    shape = (2, 2, 2)
    cases = [(True, False), (False, True)]
    results = run_ranks(_run_all, 8, shape, cases, timeout=600)
    for i, (z3, pure) in enumerate(cases):
        _check(shape, [r[i] for r in results], z3, pure)


def _steps(model, opt, steps, rank, world, T):
    _steps_on(model, opt, lambda step: _tp.tokens(step, rank // T, world // T), steps)


def _steps_on(model, opt, data, steps=range(3)):
    for step in steps:
        opt.zero_grad()
        model(data(step)).backward()
        opt.step()
    opt.wait_publish()


def _resume(rank, world, path, z3, saved, loaded):
    """Three steps on mesh `saved` and a checkpoint; loaded on each mesh of `loaded`, two steps
    more each; and the uninterrupted five steps on `saved`."""
    out = {}
    model, opt = _setup(saved, z3, False)
    _steps(model, opt, range(3), rank, world, saved[-1])
    dmuon.save_checkpoint(path, model, opt)
    for shape in loaded:
        model, opt = _setup(shape, z3, False)
        dmuon.load_checkpoint(path, model, opt)
        _steps(model, opt, range(3, STEPS), rank, world, shape[-1])
        out[shape] = full_params(model, model._dmuon_state)
    model, opt = _setup(saved, z3, False)
    _steps(model, opt, range(STEPS), rank, world, saved[-1])
    out["uninterrupted"] = full_params(model, model._dmuon_state)
    return out


@pytest.mark.slow
@pytest.mark.parametrize(
    "world,saved,loaded,z3",
    [
        (4, (2, 2), ((4, 1), (2, 2)), True),  # (dp, tp): TP 2 -> 1 and 2 -> 2
        (4, (2, 2), ((4, 1), (2, 2)), False),
        (8, (2, 2, 2), ((2, 4, 1), (1, 4, 2), (2, 2, 2)), True),  # HSDP + TP
    ],
)
def test_checkpoint_reshards_across_tensor_parallel_degrees(tmp_path, world, saved, loaded, z3):
    results = run_ranks(_resume, world, str(tmp_path / "ckpt"), z3, saved, loaded, timeout=600)
    ref = _reference(False)
    for key in (*loaded, "uninterrupted"):
        _close(ref, [r[key] for r in results], key)
    for r in results:  # the resumed run on the saved mesh equals the uninterrupted one, bitwise
        for n, want in r["uninterrupted"].items():
            assert torch.equal(r[saved][n], want), n


def _compiled(rank, world, z3):
    """Each block compiled alone (fullgraph: any graph break raises), torchtitan's order:
    parallelize_module, dedicate_params, torch.compile per block, fully_shard; against eager."""
    out = {}
    for mode in ("eager", "compiled"):
        counters.clear()
        model, opt = _setup((2, 2), z3, False, compile_blocks=mode == "compiled")
        _steps(model, opt, range(3), rank, world, 2)
        out[mode] = full_params(model, model._dmuon_state)
        out[f"{mode} breaks"] = sum(counters["graph_break"].values())
        out[f"{mode} frames"] = counters["stats"]["unique_graphs"]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("z3", [True, False])
def test_tensor_parallel_blocks_compile_without_graph_breaks(z3):
    for r in run_ranks(_compiled, 4, z3, timeout=600):
        assert r["compiled breaks"] == 0 and r["compiled frames"] == 2, r  # one per block
        for n, want in r["eager"].items():
            err = ((r["compiled"][n] - want).norm() / want.norm()).item()
            assert err < 1e-5, (n, err)


class _Tail(nn.Module):
    """A column-parallel layer with one output row over two tensor ranks: one part is empty."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.body, self.tail = nn.Linear(8, 16), nn.Linear(16, 1, bias=False)

    def forward(self, x):
        return self.tail(self.body(x)).square().mean()


def _x(step):
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(step))


def _empty_part(rank, world):
    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp"))
    model = parallelize_module(
        _Tail(), mesh["tp"], {"tail": ColwiseParallel(output_layouts=Replicate())}
    )
    dmuon.dedicate_params(model, mesh["dp"], pure=True)
    opt = muon_fp32(model)
    _steps_on(model, opt, lambda step: _x(step))
    return dict(params=full_params(model, model._dmuon_state), ns_calls=opt.ns_calls)


def test_a_matrix_with_an_empty_part_steps_like_the_whole():
    results = run_ranks(_empty_part, 2)
    ref = reference(
        "", 1, 3, {"body.weight", "tail.weight"}, HP, model=_Tail(), loss=lambda m, s, r: m(_x(s))
    )
    _close(ref, [r["params"] for r in results], "empty part")
    assert sum(r["ns_calls"] for r in results) == 3 * 2


def _mixed(rank, world):
    """param_dtype=bf16 on a (dp 2, tp 2) mesh: the TP modules compute with bf16 DTensors,
    the masters and the momentum stay fp32."""
    mesh, shard, _, data = _mesh((2, 2))
    model = _tp.parallelize(_tp.TPModel(), mesh["tp"])
    dmuon.dedicate_params(model, shard, _tp.is_matrix, param_dtype=torch.bfloat16)
    fully_shard(model, mesh=data, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    opt = muon_fp32(model)
    seen = {}
    q = model.layers[0].q_proj
    # runs after the gather's pre-hook: sees what the module computes with
    q.register_forward_pre_hook(
        lambda m, a: seen.update(q=(type(m.weight).__name__, m.weight.dtype))
    )
    st = model._dmuon_state
    steps = []
    for step in range(3):
        opt.zero_grad()
        model(_tp.tokens(step, rank // 2, 2)).backward()
        result, before = oracle.checked_step(model, opt)
        steps.append(result)
        if step == 0:
            first = {n: s["g"] for n, s in before.items()}
    opt.wait_publish()
    return dict(
        steps=steps,
        grads=first,
        seen=seen["q"],
        masters={e.param.dtype for e in st.entries if st.is_global_owner(e)},
        states={
            str(v.dtype)
            for s in opt.state.values()
            for k, v in s.items()
            if k == "momentum_buffer" and v.numel()
        },
    )


def test_mixed_precision_on_a_tensor_parallel_mesh():
    results = run_ranks(_mixed, 4)
    ref = _tp.TPModel()
    ref(_tp.tokens(0)).backward()
    for r in results:
        assert r["seen"] == ("DTensor", torch.bfloat16)
        assert r["masters"] == {torch.float32} and r["states"] == {"torch.float32"}
        # the first step's gradients, bf16 forward and backward (unit roundoff 2^-8) against
        # fp32's: measured ≤ 1.1%; a gradient summed over the data ranks, or one rank's only,
        # is 50-100% off
        for n, p in ref.named_parameters():
            err = rel_err(r["grads"][n], p.grad)
            assert err < 2e-2, (n, err)
    # each step's update against the float64 oracle on the gradient and state it consumed
    oracle.assert_steps([r["steps"] for r in results], "tp bf16")
