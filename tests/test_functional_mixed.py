"""Mixed precision in the compiled functional step: a bf16 model, fp32 masters and fp32 state.

`plan(..., param_dtype=bf16)`: the global owner keeps an fp32 master and fp32 optimizer state,
every gather broadcasts the bf16 copy, gradients are summed in bf16 (`reduce_dtype` default),
and under HSDP the publish sends the bf16 copy to the other replicas' local owners. The compiled
step (one graph, no graph break, no recompile) follows the object API's bf16 run with fp32
masters (`dedicate_params(pure=True)` on the bf16 model, same plan, same batches) within the
object API's mixed-precision tolerance (tests/test_training.py: 2e-2 relative against the fp32
reference; the two faces agree far closer: equal losses, gradients and masters within
~0.2% on an AMD EPYC, AVX-512).
On W = 2 and HSDP 2×2, Z2 and Z3 (staged).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters
from torch.distributed.device_mesh import init_device_mesh

import dmuon_fn as dmuon
from tests import _oracle as oracle
from tests._dist import run_ranks
from tests._models import HP, batch, make, meshes, muon_fp32
from tests.test_functional import CFG, STEPS
from tests.test_functional_z3 import stages

BF16, FP32 = torch.bfloat16, torch.float32
TOL = 2e-2  # the object API's mixed-precision tolerance
NAME = "transformer"  # cross-entropy: full-rank gradients (see test_training's toy-loss caveat)


def _owner_src(fp, n):
    s, r = o if isinstance(o := fp.partition.owner(n), tuple) else (o, 0)
    return r * fp.shard_size + s


def _functional(rank, world, hsdp, z3):
    mesh, rep = meshes(world, hsdp)
    model = make(NAME).to(BF16)
    fp = dmuon.plan(model, mesh, replicate_mesh=rep, param_dtype=BF16)
    state = dmuon.init(model, fp, CFG)

    def loss_fn(params, x):
        return torch.func.functional_call(model, params, (x,))

    def train_step(state, x, lr, alr):
        vg = dmuon.value_and_grad(stages(model, NAME) if z3 else loss_fn, fp)
        loss, grads = vg(state.params, x)
        return loss, grads, dmuon.update(grads, state, lr=lr, adamw_lr=alr)

    torch._dynamo.reset()
    counters.clear()
    cnt = CompileCounterWithBackend("aot_eager")
    step_fn = torch.compile(train_step, backend=cnt, fullgraph=True)
    losses, first, steps = [], None, []
    for step in range(STEPS):
        lr, alr = (torch.tensor(HP[k] / (step + 1)) for k in ("lr", "adamw_lr"))
        old = state
        loss, grads, state = step_fn(old, batch(NAME, step, rank), lr, alr)
        steps.append(oracle.check(*_seen(old, grads, state, fp), lr_factor=1 / (step + 1)))
        losses.append(loss.float().item())
        if step == 0:
            first = _gathered(grads, fp)
    return dict(
        steps=steps,
        losses=losses,
        grads=first,
        params=_gathered(state.params, fp),
        loss_dtype=loss.dtype,
        grad_dtypes={g.dtype for g in grads.values()},
        masters={state.params[n].dtype for n in fp.names if fp.is_global_owner(n)},
        # after the steps: what the last publish left on the other replicas' local owners
        replicas={
            state.params[n].dtype
            for n in fp.names
            if fp.is_local_owner(n) and not fp.is_global_owner(n)
        },
        states={t.dtype for n in fp.names if fp.is_global_owner(n) for t in state.opt[n] if t.ndim},
        frames=cnt.frame_count,
        breaks=sum(counters["graph_break"].values()),
    )


def _seen(old, grads, new, fp):
    """What this rank's step saw and made for the parameters it owns, for the step oracle."""
    before, after, kinds = {}, {}, {}
    for n in fp.names:
        if not fp.is_global_owner(n):
            continue
        s = old.opt[n]
        kinds[n] = "muon" if n in fp.muon else "adamw"
        state = (
            dict(buf=s.momentum)
            if kinds[n] == "muon"
            else dict(m=s.exp_avg, v=s.exp_avg_sq, t=s.step)
        )
        before[n] = dict(W=old.params[n], g=grads[n], **state)
        after[n] = new.params[n]
    return before, after, kinds


def _gathered(tensors, fp):
    """Each global owner's tensor (fp32 masters, or gradients) in full on every rank."""
    out = {}
    for n in fp.names:
        t = tensors[n]
        buf = t.detach().float().clone() if fp.is_global_owner(n) else torch.empty(fp.shape(n))
        if dist.is_initialized():
            dist.broadcast(buf, src=_owner_src(fp, n))
        out[n] = buf
    return out


def _object(rank, world, hsdp):
    mesh, rep = meshes(world, hsdp)
    mesh = mesh if mesh is not None else init_device_mesh("cpu", (1,))
    model = make(NAME).to(BF16)
    dmuon.dedicate_params(model, mesh, replicate_mesh=rep, pure=True)
    opt = muon_fp32(model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    st = model._dmuon_state
    losses, first = [], None
    for step in range(STEPS):
        opt.zero_grad()
        loss = model(batch(NAME, step, rank))
        loss.backward()
        dmuon.wait_gradients(model)
        losses.append(loss.float().item())
        if step == 0:
            first = _object_full(model, st, "grad")
        opt.step()
        sched.step()
    opt.wait_publish()
    return dict(losses=losses, grads=first, params=_object_full(model, st, "param"))


def _object_full(model, st, what):
    out = {}
    for n, p in model.named_parameters():
        e = st.entry(p)
        t = p if what == "param" else p.grad
        buf = t.detach().float().clone() if st.is_global_owner(e) else torch.empty(e.shape)
        dist.broadcast(buf, src=e.owner_replica * st.shard_size + e.owner_shard)
        out[n] = buf
    return out


def _both(rank, world, hsdp):
    return dict(
        z2=_functional(rank, world, hsdp, False),
        z3=_functional(rank, world, hsdp, True),
        obj=_object(rank, world, hsdp),
    )


def _rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _check(results, hsdp):
    for mode in ("z2", "z3"):
        oracle.assert_steps([r[mode]["steps"] for r in results], mode)
    for r in results:
        obj = r["obj"]
        for mode in ("z2", "z3"):
            fn = r[mode]
            assert fn["frames"] == 1 and fn["breaks"] == 0, (mode, "one graph, no break")
            assert fn["loss_dtype"] == BF16, "the loss is computed with bf16 parameters"
            assert fn["grad_dtypes"] == {BF16}, "gradients summed in bf16"
            assert fn["masters"] == {FP32} and fn["states"] == {FP32}, "fp32 masters and state"
            if hsdp:
                assert fn["replicas"] == {BF16}, "the other replicas hold the bf16 copy"
            for step, (a, b) in enumerate(zip(fn["losses"], obj["losses"], strict=True)):
                assert abs(a - b) <= TOL * abs(b), (mode, step, a, b)
            for n, g in obj["grads"].items():
                assert _rel(fn["grads"][n], g) < TOL, (mode, "grad", n)
            for n, p in obj["params"].items():
                assert _rel(fn["params"][n], p) < TOL, (mode, "master", n)


def test_world_2_bf16_follows_the_object_api():
    _check(run_ranks(_both, 2, False), False)


@pytest.mark.slow
def test_hsdp_2x2_bf16_follows_the_object_api():
    _check(run_ranks(_both, 4, True), True)


def test_param_dtype_none_holds_the_model_dtype():
    """Without param_dtype nothing changes: the held values are the model's (no master)."""
    model = make(NAME).to(BF16)
    state = dmuon.init(model, dmuon.plan(model), CFG)
    assert {t.dtype for t in state.params.values()} == {BF16}
    mixed = dmuon.init(model, dmuon.plan(model, param_dtype=BF16), CFG)
    assert {t.dtype for t in mixed.params.values()} == {FP32}
    for n, t in mixed.params.items():
        assert torch.equal(t.to(BF16), state.params[n]), n
    with pytest.raises(ValueError, match=r"param_dtype must be a floating torch\.dtype"):
        dmuon.plan(model, param_dtype=torch.int8)
    with pytest.raises(ValueError, match=r"reduce_dtype must be a floating torch\.dtype"):
        dmuon.plan(model, reduce_dtype="bf16")
