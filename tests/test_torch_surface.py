"""torch's own gradient tools on a dedicated model (proofs/torch_surface.md): the total norm
and clipping that trainers call (`clip_grad_norm_`, torchtitan's `get_total_norm` +
`clip_grads_with_norm_`, `clip_grad_value_`) against the same model on one process."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.optim.optimizer import register_optimizer_step_post_hook

import dmuon_fn as dmuon
from tests import _tp
from tests._dist import run_ranks
from tests._models import batch, full_params, is_proj, make, meshes, muon_fp32
from tests.test_tensor_parallel import _first_norm, _setup
from tests.test_training import _full, _rel

MAX_NORM = 0.05


TEAMS = {"layers.0.up_proj.weight": 2, "layers.1.down_proj.weight": 2}  # cut by rows, columns


def _model(world, hsdp, pure=False, teams=None):
    """The Quick Start's model: projections dedicated, the rest on FSDP2; `pure`: every
    parameter dedicated (AdamW on the owners of non-matrices), no FSDP2; `teams`: matrices
    held in pieces."""
    mesh, rep = meshes(world, hsdp)
    model = make("mlp")
    pred = None if pure else is_proj
    dmuon.dedicate_params(model, mesh, pred, replicate_mesh=rep, pure=pure, teams=teams)
    if not pure:
        fully_shard(model, mesh=mesh if rep is None else mesh._get_root_mesh())
    return model


def _reference(world, norm_type=2.0, how="norm"):
    """(total norm, clipped gradients) of the one-process model on the ranks' batches."""
    ref = make("mlp")
    (sum(ref(batch("mlp", 0, r)) for r in range(world)) / world).backward()
    if how == "value":
        torch.nn.utils.clip_grad_value_(ref.parameters(), 1e-3)
        total = 0.0
    else:
        total = torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM, norm_type).item()
    return total, {n: p.grad for n, p in ref.named_parameters()}


def _clip(rank, world, hsdp, norm_type, how, all_dedicated):
    model = _model(world, hsdp, pure=all_dedicated)
    model(batch("mlp", 0, rank)).backward()  # no wait: after backward .grad is final
    params = list(model.parameters())
    if how == "norm":
        total = torch.nn.utils.clip_grad_norm_(params, MAX_NORM, norm_type)
    elif how == "titan":  # torchtitan's dist_utils.clip_grad_norm_
        grads = [p.grad for p in params if p.grad is not None]
        total = torch.nn.utils.get_total_norm(grads, norm_type)
        if hasattr(total, "full_tensor"):
            total = total.full_tensor()
        torch.nn.utils.clip_grads_with_norm_(params, MAX_NORM, total)
    else:
        torch.nn.utils.clip_grad_value_(params, 1e-3)
        total = torch.zeros(())
    total = total.full_tensor() if hasattr(total, "full_tensor") else total
    muon_fp32(model)  # Muon takes the model as a trainer would after this
    return total.item(), _full(model, "grad")


CASES = [  # (world, hsdp, norm type, how, every parameter dedicated)
    (4, False, 2.0, "norm", False),
    (4, True, 2.0, "norm", False),
    (4, False, math.inf, "norm", True),  # (FSDP2's empty shards: torch has no inf norm of them)
    (4, False, 1.0, "titan", False),
    (4, True, 2.0, "titan", False),
    (4, False, 2.0, "norm", True),
    (4, True, 2.0, "value", False),
]


@pytest.mark.parametrize("world,hsdp,norm_type,how,all_dedicated", CASES)
def test_torch_clipping_equals_one_process(world, hsdp, norm_type, how, all_dedicated):
    want, ref = _reference(world, norm_type, "value" if how == "value" else "norm")
    got = run_ranks(_clip, world, hsdp, norm_type, how, all_dedicated)
    assert want > MAX_NORM or how == "value"  # the case clips
    for total, grads in got:
        assert total == got[0][0]  # every rank: the same norm, so the same coefficient
        if how != "value":
            assert abs(total - want) <= 1e-6 * want, (total, want)
        for n, g in ref.items():
            assert _rel(grads[n], g) < 1e-5, n


def _placeholders(rank, world):
    """Which dedicated parameters have a .grad after backward, per rank (owners: full)."""
    model = _model(world, False)
    model(batch("mlp", 0, rank)).backward()
    st = model._dmuon_state
    return {
        n: (None if p.grad is None else tuple(p.grad.shape), st.is_global_owner(st.entry(p)))
        for n, p in model.named_parameters()
        if st.entry(p) is not None
    }


def test_every_rank_has_a_grad_where_the_owner_has_one():
    for seen in run_ranks(_placeholders, 2):
        for n, (shape, owner) in seen.items():
            assert shape is not None, n
            assert (shape != (0,)) == owner, (n, shape, owner)


def _local_norm(rank, world):
    """A norm of tensors that are not a dedicated model's gradients stays local (no
    collective): rank 1 alone calls it."""
    model = _model(world, False)
    model(batch("mlp", 0, rank)).backward()
    x = torch.full((3,), float(rank + 1))
    local = torch.nn.utils.get_total_norm([x]).item() if rank == 1 else 0.0
    dist.barrier()
    return local


def test_a_norm_of_other_tensors_is_torch_s_own():
    assert run_ranks(_local_norm, 2)[1] == pytest.approx(2 * math.sqrt(3))


# ---- state dicts ----------------------------------------------------------------------------


def _trained(rank, world, hsdp, pure=False, steps=2, teams=None):
    model = _model(world, hsdp, pure=pure, teams=teams)
    opt = muon_fp32(model)
    for step in range(steps):
        opt.zero_grad()
        model(batch("mlp", step, rank)).backward()
        opt.step()
    opt.wait_publish()
    return model, opt


def _export(rank, world, hsdp, pure, teams):
    """The full state dict rank 0 exports (torch's API, CPU offload), the model's own full
    values, and the keys and types of model.state_dict()."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    model, _ = _trained(rank, world, hsdp, pure, teams=teams)
    sd = model.state_dict()
    kinds = {k: (type(v).__name__, tuple(v.shape)) for k, v in sd.items()}
    full = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    return kinds, {k: v.clone() for k, v in full.items()}, full_params(model)


@pytest.mark.parametrize(
    "hsdp,pure,teams", [(False, False, None), (True, False, None), (False, True, None),
                        (True, False, TEAMS)],
)  # fmt: skip
def test_full_state_dict_loads_into_the_plain_model(hsdp, pure, teams):
    got = run_ranks(_export, 4, hsdp, pure, teams)
    plain = make("mlp")
    want_keys = {k: tuple(v.shape) for k, v in plain.state_dict().items()}
    for rank, (kinds, full, params) in enumerate(got):
        assert {k: s for k, (_, s) in kinds.items()} == want_keys
        assert all(t == "DTensor" for k, (t, _) in kinds.items() if "proj" in k)
        if rank == 0:
            assert set(full) == set(want_keys)
            for n, v in full.items():
                assert v.device.type == "cpu" and torch.equal(v, params[n].to(v.dtype)), n
            plain.load_state_dict(full, strict=True)
        else:
            assert full == {}  # cpu_offload: rank 0 only
    assert not torch.equal(
        plain.layers[0]["up_proj"].weight, make("mlp").layers[0]["up_proj"].weight
    )


def _dcp_save(rank, world, hsdp, path, teams):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    model, _ = _trained(rank, world, hsdp, teams=teams)
    dcp.save(get_model_state_dict(model), checkpoint_id=path)
    return full_params(model), _probe(model)


def _probe(model):
    """The loss of one batch: every replica computes with its own copies."""
    with torch.no_grad():
        return model(batch("mlp", 9, 0)).item()


def _dcp_load(rank, world, hsdp, path, full_from_rank0, teams):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )

    model = _model(world, hsdp, teams=teams)
    if full_from_rank0:  # a plain model's weights, read on rank 0 alone
        sd = {}
        if rank == 0:
            plain = make("mlp")
            sd = {k: v for k, v in plain.state_dict().items()}
            dcp.load(sd, checkpoint_id=path, no_dist=True)
        opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_model_state_dict(model, sd, options=opts)
    else:
        sd = get_model_state_dict(model)
        dcp.load(sd, checkpoint_id=path)
        set_model_state_dict(model, sd)
    return full_params(model), _probe(model)


@pytest.mark.parametrize(
    "save,load,from_rank0,teams",
    [((4, False), (4, False), False, None), ((4, False), (2, False), False, None),
     ((4, False), (4, True), False, None), ((4, True), (2, False), True, None),
     ((4, True), (4, False), False, TEAMS)],
)  # fmt: skip
def test_dcp_round_trip_through_torch_s_state_dict_on_any_world(
    tmp_path, save, load, from_rank0, teams
):
    path = str(tmp_path / "ckpt")
    saved, loss = run_ranks(_dcp_save, save[0], save[1], path, teams)[0]
    for got, probe in run_ranks(_dcp_load, load[0], load[1], path, from_rank0, teams):
        assert probe == pytest.approx(loss, rel=1e-6)  # every replica's copies were loaded
        assert set(got) == set(saved)
        for n in saved:
            assert torch.equal(got[n], saved[n]), n


# ---- the optimizer's state through torch's distributed state dict ---------------------------

ROWS, STEPS, SPLIT = 8, 4, 2


def _global_batch(step, rank, world):
    """Rows of one global batch: the same data on any world size."""
    x = torch.randn(ROWS, 32, generator=torch.Generator().manual_seed(7 + step))
    per = ROWS // world
    return x[rank * per : (rank + 1) * per]


def _momenta(model, opt):
    """Every parameter's first state tensor (Muon's momentum, AdamW's exp_avg), whole."""

    def first(p):
        s = opt.state[p]
        return s["momentum_buffer"] if "momentum_buffer" in s else s["exp_avg"]

    return full_params(model, get=first, cast=False)


def _resume(rank, world, hsdp, path, save, flatten, teams):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        get_state_dict,
        set_state_dict,
    )

    model = _model(world, hsdp, teams=teams)
    opt = muon_fp32(model)
    opts = StateDictOptions(flatten_optimizer_state_dict=flatten)

    def train(steps):
        for step in steps:
            opt.zero_grad()
            model(_global_batch(step, rank, world)).backward()
            opt.step()
        opt.wait_publish()

    out = {}
    if save:
        train(range(SPLIT))
        msd, osd = get_state_dict(model, opt, options=opts)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
        full = get_optimizer_state_dict(
            model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        out["full_momentum"] = {
            n: s["momentum_buffer"].clone() for n, s in full.get("state", {}).items() if "proj" in n
        }
    else:
        msd, osd = get_state_dict(model, opt, options=opts)
        sd = {"model": msd, "optim": osd}
        dcp.load(sd, checkpoint_id=path)
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    out["momentum"] = _momenta(model, opt)
    train(range(SPLIT, STEPS))
    out["params"] = full_params(model, cast=False)
    return out


@pytest.mark.parametrize(
    "load,flatten,teams",
    [((4, False), False, None), ((4, False), True, None), ((2, False), False, None),
     ((4, True), True, None), ((4, True), False, TEAMS)],
)  # fmt: skip
def test_get_state_dict_and_dcp_resume(tmp_path, load, flatten, teams):
    path = str(tmp_path / "ckpt")
    saved = run_ranks(_resume, 4, False, path, True, flatten, teams)
    ref = saved[0]
    for n, m in ref["full_momentum"].items():  # rank 0's full optimizer dict: the momentum
        assert torch.equal(m, ref["momentum"][n]), n
    assert all(r["full_momentum"] == {} for r in saved[1:])  # cpu_offload: rank 0 only
    exact = load == (4, False)
    for got in run_ranks(_resume, load[0], load[1], path, False, flatten, teams):
        for what in ("momentum", "params"):
            for n, want in ref[what].items():
                if exact:
                    assert torch.equal(got[what][n], want), (what, n)
                else:
                    assert _rel(got[what][n], want) < 1e-5, (what, n)


def _per_rank(rank, world, path):
    """optimizer.state_dict() per rank: no communication, back bit-exactly; another world's
    is refused with the way to load elsewhere."""
    model = _model(world, False)
    opt = muon_fp32(model)
    model(batch("mlp", 0, rank)).backward()
    opt.step()
    torch.save(opt.state_dict(), f"{path}.{world}.{rank}")
    before = {k: {j: t.clone() for j, t in s.items()} for k, s in opt.state_dict()["state"].items()}
    opt.load_state_dict(torch.load(f"{path}.{world}.{rank}", weights_only=False))
    after = opt.state_dict()["state"]
    same = all(torch.equal(before[k][j], after[k][j]) for k in before for j in before[k])
    dist.barrier()
    other = f"{path}.{world}.{(rank + 1) % world}"  # another rank's: another plan's parts
    try:
        opt.load_state_dict(torch.load(other, weights_only=False))
        refused = ""
    except ValueError as err:
        refused = str(err)
    return same, refused


def test_optimizer_state_dict_per_rank_round_trips(tmp_path):
    for same, refused in run_ranks(_per_rank, 2, str(tmp_path / "opt")):
        assert same
        assert "get_optimizer_state_dict" in refused


# ---- torch.optim conventions ------------------------------------------------------------------

FROZEN = "layers.0.up_proj.weight"  # dedicated: frozen for steps 0-1, unfrozen from step 2


def _conventions(rank, world, set_to_none):
    """3 steps with a dedicated matrix frozen, then unfrozen; the step hooks' calls; the full
    parameters after each step."""
    model = _model(world, hsdp=False)
    opt = muon_fp32(model)
    frozen = model.get_parameter(FROZEN)
    frozen.requires_grad_(False)
    calls, seen = [], []
    opt.register_step_pre_hook(lambda o, a, k: calls.append(("pre", o is opt)))
    opt.register_step_post_hook(lambda o, a, k: calls.append(("post", o is opt)))
    glob = register_optimizer_step_post_hook(lambda o, a, k: calls.append(("global", o is opt)))
    for step in range(3):
        if step == 2:
            frozen.requires_grad_(True)
        opt.zero_grad(set_to_none=set_to_none)
        model(batch("mlp", step, rank)).backward()
        opt.step()
        opt.wait_publish()
        seen.append(_full(model))
    glob.remove()
    hooks = list(calls)  # (the refused step below runs the pre-hook too)
    sd = opt.state_dict()
    sd["param_groups"][0]["lr"] = 0.125  # a scheduler's, saved: load_state_dict restores it
    opt.load_state_dict(sd)
    assert opt.param_groups[0]["lr"] == 0.125 and opt.param_groups[0]["params"][0] is not None
    try:
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))]})
        refused = ""
    except ValueError as err:
        refused = str(err)
    group = opt.param_groups[0]
    own = list(group["params"])
    group["params"] = own[::-1]  # the model's own, mixed up (accelerate's FSDP2 prepare)
    opt.zero_grad()
    restored = all(a is b for a, b in zip(group["params"], own, strict=True))
    group["params"] = [torch.zeros(1) for _ in own]
    try:
        opt.step()
    except ValueError as err:
        refused += "\n" + str(err)
    return hooks, seen, refused, restored


def test_zero_grad_kept_grads_hooks_and_param_groups():
    """zero_grad(set_to_none=False) trains as set_to_none=True (bit for bit, a frozen matrix
    unfrozen on the way included); the step pre/post hooks and torch's global hook run once per
    step; add_param_group after construction says why not; a group's parameters replaced by
    the model's own in another order are put back, by other tensors refused."""
    for rank_got in zip(*(run_ranks(_conventions, 2, s) for s in (True, False)), strict=True):
        (calls, kept, refused, restored), (calls_f, zeroed, _, _) = rank_got
        assert calls == calls_f == [("pre", True), ("post", True), ("global", True)] * 3
        for a, b in zip(kept, zeroed, strict=True):
            assert all(torch.equal(a[n], b[n]) for n in a)
        assert torch.equal(kept[0][FROZEN], kept[1][FROZEN])  # frozen: not updated
        assert not torch.equal(kept[1][FROZEN], kept[2][FROZEN])  # unfrozen: updated
        assert "already holds every parameter" in refused
        assert restored and "were replaced by tensors that are not" in refused


def _clip_tp(rank, world):
    model, _ = _setup((2, 2), z3=True, pure=False)
    T = 2
    model(_tp.tokens(0, rank // T, world // T)).backward()
    params = list(model.parameters())
    total = torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
    after = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    as_float = [t.full_tensor() if hasattr(t, "full_tensor") else t for t in (total, after)]
    return [t.item() for t in as_float]


def test_torch_clipping_on_a_tensor_parallel_mesh():
    """(dp 2, tp 2): torch's clip_grad_norm_ gives the one-process norm on every rank, and the
    norm after it is torch's max_norm·total/(total + 1e-6) (every part, split or copied, scaled
    by the same coefficient)."""
    want = _first_norm().item()
    assert want > MAX_NORM
    for total, after in run_ranks(_clip_tp, 4):
        assert total == pytest.approx(want, rel=1e-6)
        assert after == pytest.approx(MAX_NORM * total / (total + 1e-6), rel=1e-6)
