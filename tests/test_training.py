"""Training features of the object API against plain PyTorch: global-norm clipping, gradient
accumulation, mixed precision, non-finite and all-zero gradients, empty owners, setup mismatch
detection, and collective failures that name their phase."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import dmuon_fn as dmuon
from dmuon_fn import CollectiveError
from tests import _oracle as oracle
from tests._dist import run_ranks
from tests._models import HP, batch, is_proj, make, meshes, muon_fp32, reference

TOL = 5e-5


def _setup(world, hsdp=False, predicate=is_proj, mp=None, name="mlp", **opt_kw):
    mesh, rep = meshes(world, hsdp)
    model = make(name)
    kw = {} if mp is None else {"param_dtype": mp}
    dmuon.dedicate_params(model, mesh, predicate, replicate_mesh=rep, **kw)
    full_mesh = mesh if rep is None else mesh._get_root_mesh()
    policy = MixedPrecisionPolicy() if mp is None else MixedPrecisionPolicy(param_dtype=mp)
    fully_shard(model, mesh=full_mesh, mp_policy=policy)
    return model, muon_fp32(model, replicate_async=False, **opt_kw)


def _full(model, what="param"):
    """Every parameter's (or gradient's) full value on every rank (test-only gather)."""
    st = model._dmuon_state
    if what == "grad":
        dmuon.wait_gradients(model)  # backward leaves the dedicated reduces in flight
    out = {}
    for n, p in model.named_parameters():
        t = p if what == "param" else p.grad
        e = st.entry(p)
        if e is None:
            out[n] = t.full_tensor().detach().float() if hasattr(t, "full_tensor") else t.detach()
            continue
        buf = t.detach().float().clone() if st.is_global_owner(e) else torch.empty(e.shape)
        dist.broadcast(buf, src=e.owner_replica * st.shard_size + e.owner_shard)
        out[n] = buf
    return out


def _state(opt):
    return [{k: v.clone() for k, v in s.items()} for s in opt.state.values()]


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


# ---- clipping -------------------------------------------------------------------------------


def _clip(rank, world, hsdp):
    model, opt = _setup(world, hsdp)
    model(batch("mlp", 0, rank)).backward()
    total = opt.clip_grad_norm_(0.05)
    return total.item(), _full(model, "grad")


@pytest.mark.parametrize("world,hsdp", [(2, False), (4, True)])
def test_clip_equals_torch_clip_grad_norm(world, hsdp):
    ref = make("mlp")
    (sum(ref(batch("mlp", 0, r)) for r in range(world)) / world).backward()
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05).item()
    for total, grads in run_ranks(_clip, world, hsdp):
        assert abs(total - want) / want < 1e-5, (total, want)
        assert want > 0.05  # the case clips
        for n, p in ref.named_parameters():
            assert _rel(grads[n], p.grad) < 1e-5, n


def _clip_in_step(rank, world):
    out = []
    for by_step in (True, False):
        model, opt = _setup(world, max_grad_norm=0.05 if by_step else None)
        for step in range(3):
            opt.zero_grad()
            model(batch("mlp", step, rank)).backward()
            if not by_step:
                opt.clip_grad_norm_(0.05)
            opt.step()
        out.append((_full(model), opt.grad_norm.item()))
    return out


def _norms_without_step(rank, world):
    """A loss-spike guard that skips the step: the next clip must see the new gradients."""
    model, opt = _setup(world)
    out = []
    for step in range(2):
        opt.zero_grad()
        model(batch("mlp", step, rank)).backward()
        out.append(opt.clip_grad_norm_(0.05).item())
    return out


def test_clip_norm_is_fresh_after_zero_grad_without_a_step():
    want = []
    for step in range(2):
        ref = make("mlp")
        (sum(ref(batch("mlp", step, r)) for r in range(2)) / 2).backward()
        want.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05).item())
    for got in run_ranks(_norms_without_step, 2):
        assert all(abs(g - w) / w < 1e-5 for g, w in zip(got, want, strict=True)), (got, want)


def test_max_grad_norm_in_step_equals_explicit_clip():
    (a, na), (b, nb) = run_ranks(_clip_in_step, 2)[0]
    assert na == nb > 0
    assert all(torch.equal(a[n], b[n]) for n in a)


# ---- accumulation and mixed precision -------------------------------------------------------


def _accumulate(rank, world, micro):
    model, opt = _setup(world)
    for step in range(2):
        opt.zero_grad()
        x = batch("mlp", step, rank)
        for chunk in x.chunk(micro):
            (model(chunk) / micro).backward()
        opt.step()
    return _full(model)


def test_accumulation_equals_one_big_batch():
    big, acc = (run_ranks(_accumulate, 2, m)[0] for m in (1, 4))
    for n in big:
        assert _rel(acc[n], big[n]) < 1e-5, n


def _mixed(rank, world):
    model, opt = _setup(world, mp=torch.bfloat16)
    st = model._dmuon_state
    seen = {}
    # runs after the gather's pre-hook: sees the copy the module computes with
    model.layers[0]["up_proj"].register_forward_pre_hook(
        lambda m, a: seen.update(dtype=m.weight.dtype)
    )
    comm = dmuon.CommCounter()
    grads, steps = {}, []
    for step in range(4):
        opt.zero_grad()
        with comm, comm.phase("backward"):
            model(batch("mlp", step, rank)).backward()
        if step == 0:
            grads = _full(model, "grad")
        steps.append(oracle.checked_step(model, opt)[0])
    # fp32 masters: dtype, and they hold values a bf16 parameter could not
    masters = {
        e.name: (e.param.dtype, not torch.equal(e.param, e.param.bfloat16().float()))
        for e in st.entries
        if st.is_global_owner(e)
    }
    states = {str(v.dtype) for s in opt.state.values() for k, v in s.items() if k != "step"}
    reduced = comm.stats["backward"].op_bytes["reduce_"]
    return seen["dtype"], masters, states, reduced, grads, steps


def test_mixed_precision_bf16_compute_fp32_masters_and_state():
    ref = make("mlp")
    (sum(ref(batch("mlp", 0, r)) for r in range(2)) / 2).backward()
    numel = sum(p.numel() for n, p in ref.named_parameters() if is_proj(n, p))
    results = run_ranks(_mixed, 2)
    # each step's update against the float64 oracle on the gradient and state it consumed
    oracle.assert_steps([r[-1] for r in results], "bf16")
    for gathered, masters, states, reduce_bytes, grads, _ in results:
        assert gathered == torch.bfloat16
        assert masters and set(masters.values()) == {(torch.float32, True)}
        assert states == {"torch.float32"}
        # the dedicated gradients were summed in bf16: 2 bytes, (W-1)/W per element, 4 steps
        assert reduce_bytes == 4 * numel * 2 // 2
        for n, p in ref.named_parameters():
            # bf16 forward and backward against the fp32 reference (a one-process bf16 copy of
            # the model is as far from it: 0.5-1.1%); a gradient summed over the ranks or one
            # rank's alone is 50-100% off. Parameters are not compared after steps: this toy
            # loss has rank-1 gradients for the last matrix, and Muon maps the bf16 noise in
            # their null directions to unit size, so no two bf16 runs agree there; the oracle
            # above checks each step's arithmetic instead
            assert _rel(grads[n], p.grad) < 2e-2, n


# ---- reliability ----------------------------------------------------------------------------


def _nonfinite(rank, world, hsdp, mode, clip=None):
    model, opt = _setup(world, hsdp, nonfinite=mode, max_grad_norm=clip)
    for step in range(2):
        opt.zero_grad()
        model(batch("mlp", step, rank)).backward()
        opt.step()
    before, state = _full(model), _state(opt)
    opt.zero_grad()
    model(batch("mlp", 2, rank)).backward()
    if rank == world - 1:  # one bad entry on one rank only: an FSDP2 shard of the last rank
        p = model.layers[1]["ln"].weight
        p.grad.to_local()[0] = float("nan") if hsdp else float("inf")
    raised = ""
    try:
        opt.step()
    except FloatingPointError as e:
        raised = str(e)
    after, state_after = _full(model), _state(opt)
    unchanged = all(torch.equal(before[n], after[n]) for n in before) and all(
        torch.equal(a[k], b[k]) for a, b in zip(state, state_after, strict=True) for k in a
    )
    opt.zero_grad()
    model(batch("mlp", 3, rank)).backward()
    opt.step()
    name = "layers.0.up_proj.weight"
    moved = not torch.equal(_full(model)[name], after[name])
    return unchanged, raised, opt.skipped_steps.item(), moved


@pytest.mark.parametrize("world,hsdp", [(2, False), (4, True)])
def test_nonfinite_gradient_skips_the_step_on_every_rank(world, hsdp):
    for unchanged, raised, skipped, moved in run_ranks(_nonfinite, world, hsdp, "skip"):
        assert unchanged and not raised and skipped == 1 and moved


@pytest.mark.parametrize("clip", [None, 1.0])
def test_nonfinite_gradient_raises_on_every_rank_when_asked(clip):
    results = run_ranks(_nonfinite, 2, False, "raise", clip)
    for unchanged, raised, skipped, moved in results:
        assert unchanged and "non-finite gradient" in raised and skipped == 0 and moved
    # decided before clipping: clipping by a NaN norm would have made every gradient NaN
    assert "['layers.1.ln.weight']" in results[1][1] and "another rank" in results[0][1]


def _verdict_order(rank, world, clip):
    """Per step: the Newton-Schulz runs this rank had made when the step asked for the guard's
    verdict, the bytes of computed updates it then held unwritten, its largest update's bytes and
    the bytes left unwritten after the step; and its Newton-Schulz runs in all."""
    from dmuon_fn.optim import _guard

    # matrices of two sizes, the smaller ones first in the forward
    model, opt = _setup(world, max_grad_norm=clip, name="transformer")
    seen, check, update, write = [], opt.guard.check, opt._update, _guard.write
    held = [0, 0]  # unwritten now, the largest single update

    def recorded():
        seen.append([opt.ns_calls, held[0]])
        return check()

    def updated(*args):
        writes = update(*args)
        size = sum(new.numel() * new.element_size() for _, new in writes)
        held[0], held[1] = held[0] + size, max(held[1], size)
        return writes

    def written(dst, new, ok):
        held[0] -= new.numel() * new.element_size()
        return write(dst, new, ok)

    opt.guard.check, opt._update, _guard.write = recorded, updated, written
    for step in range(2):
        opt.zero_grad()
        model(batch("transformer", step, rank)).backward()
        before, held[1] = opt.ns_calls, 0
        opt.step()
        seen[-1] = (seen[-1][0] - before, seen[-1][1], held[1], held[0])
    return seen, opt.ns_calls


@pytest.mark.parametrize("clip", [None, 1.0])
def test_the_verdict_waits_for_the_first_update_unless_it_changes_it(clip):
    """Without a clip the guard's all-reduce flies while each rank computes its first update, its
    largest matrix's Newton-Schulz (every rank owns one here), held unwritten until the verdict;
    with a clip coefficient to apply, the verdict comes before any update (proofs/guard.md 2b).
    Every update is written."""
    for seen, runs in run_ranks(_verdict_order, 2, clip):
        assert runs > 0
        for ns_before, held, largest, left in seen:
            assert left == 0, seen
            assert (ns_before, held) == ((1, largest) if clip is None else (0, 0)), seen


def _zero(rank: int, world: int):
    """Muon + AdamW (tests/test_training.py's setup) through three steps: all-zero gradients with
    weight decay 0, all-zero gradients with each group's weight decay, then a real batch.
    Returns every parameter's full value before and after each step, and per parameter the
    factor 1 − lr·wd of its group."""
    model, opt = _setup(world)
    group_of = {id(p): g for g in opt.param_groups for p in g["params"]}
    decay = {
        n: 1 - group_of[id(p)]["lr"] * group_of[id(p)]["weight_decay"]
        for n, p in model.named_parameters()
    }
    wd = [g["weight_decay"] for g in opt.param_groups]

    def step(i: int, scale: float) -> dict:
        opt.zero_grad()
        (model(batch("mlp", i, rank)) * scale).backward()
        opt.step()
        return _full(model)

    values = [_full(model)]
    for g in opt.param_groups:
        g["weight_decay"] = 0.0
    values.append(step(0, 0.0))
    for g, w in zip(opt.param_groups, wd, strict=True):
        g["weight_decay"] = w
    values.append(step(1, 0.0))
    values.append(step(2, 1.0))
    return values, decay


def test_all_zero_gradients_give_a_zero_update():
    """With weight decay 0 a step on all-zero gradients leaves every parameter's bits as they
    were (proofs/guard.md, claim 3). The step still runs: with weight decay the same zero
    gradients give W·(1 − lr·wd), the update's formula with a zero direction, and a real batch
    then moves every parameter. A step that did nothing would pass only the first check."""
    for (before, zero, decayed, trained), decay in run_ranks(_zero, 2):
        for n, w in before.items():
            assert torch.equal(zero[n], w), n
            # w·(1 − lr·wd) to fp32 rounding of the float64 factor (~1e-7), and a visible move:
            # lr·wd is far above that tolerance, and w is nonzero (a LayerNorm bias starts at 0)
            assert _rel(decayed[n], w * decay[n]) < 1e-6, n
            assert 1 - decay[n] > 1e-4, n
            assert not w.any() or _rel(decayed[n], w) > 0.5 * (1 - decay[n]), n
            assert torch.isfinite(trained[n]).all() and not torch.equal(trained[n], decayed[n]), n


TWO = {"layers.0.up_proj.weight", "layers.1.down_proj.weight"}


def _empty_owners(rank, world):
    model, opt = _setup(world, predicate=lambda n, p: n in TWO)
    for step in range(3):
        opt.zero_grad()
        model(batch("mlp", step, rank)).backward()
        opt.step()
    owned = [e.name for e in model._dmuon_state.entries if model._dmuon_state.is_global_owner(e)]
    return owned, _full(model)


def test_more_ranks_than_matrices():
    results = run_ranks(_empty_owners, 4)
    assert sum(len(owned) for owned, _ in results) == 2
    assert sum(not owned for owned, _ in results) == 2  # two ranks own nothing
    ref = reference("mlp", 4, 3, TWO, HP)
    for _, params in results:
        for n, want in ref.items():
            assert _rel(params[n], want) < TOL, n


def _mismatch(rank, world, how):
    mesh, _ = meshes(world, False)
    model = make("mlp")
    dmuon.dedicate_params(model, mesh, is_proj)
    fully_shard(model, mesh=mesh)
    kw = {}
    if how == "kernel" and rank == 1:
        os.environ["DMUON_NS_KERNEL"] = "torch_mm"  # this rank only
    if how == "config" and rank == 1:
        kw = {"ns_steps": 6}
    if how == "unavailable" and rank == 1:
        os.environ["DMUON_NS_KERNEL"] = "cublas"  # cannot run on this rank's device
    try:
        dmuon.Muon(model, **kw)
    except dmuon.PlanMismatchError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize(
    "how,what", [("kernel", "NS kernel"), ("config", "NS config"), ("unavailable", "NS kernel")]
)
def test_a_rank_with_another_kernel_or_config_is_detected_at_setup(how, what):
    for msg in run_ranks(_mismatch, 2, how):
        assert f"ranks 0 and 1 disagree on {what}" in msg, msg


def _silent_peer(rank, world, how):
    """Rank 1 leaves ("gone": the harness tears its process group down) or stays alive but
    silent ("hung": rank 0's collective must time out, not hang) before the first step."""
    mesh, _ = meshes(world, False)
    model = make("mlp")
    dmuon.dedicate_params(model, mesh, pure=True)
    opt = dmuon.Muon(model)
    if rank == 1:
        if how == "hung":
            time.sleep(8)
        return "", 0.0
    t0 = time.monotonic()
    try:
        for step in range(3):
            model(batch("mlp", step, rank)).backward()
            opt.step()
    except CollectiveError as e:
        return str(e), time.monotonic() - t0
    return "no error", 0.0


@pytest.mark.parametrize("how", ["gone", pytest.param("hung", marks=pytest.mark.slow)])
def test_a_dead_or_hung_peer_is_an_error_naming_the_phase(how):
    msg, waited = run_ranks(_silent_peer, 2, how, pg_timeout=2.0, timeout=120)[0]
    assert "a collective failed on rank 0 during forward (parameter gather) of" in msg, msg
    if how == "hung":
        assert 1.5 < waited < 8.0, waited  # the process group's 2 s timeout
