"""Sharded DCP checkpoints (object and functional API, one format) on gloo ranks.

Loading moves values (and casts where the target dtype says so); it does no arithmetic, so every
comparison of a loaded state is exact (torch.equal with equal dtypes): the loaded full state
against the saved one, on the same world, on 4 → 2, 2 → 4 and 1-D (4) → HSDP 2×2, across the two
faces (object ↔ functional, same model and plan), and a resumed run against an uninterrupted one
on the same mesh (same gloo reductions, same kernels: the same bits). A run resumed in the other
face is compared with that face's uninterrupted run within fp32 rounding (the faces sum and
scale in different orders).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import dmuon_fn as dmuon
from dmuon_fn._checkpoint import _kinds
from dmuon_fn.ns._dispatch import gram_rule
from dmuon_fn.optim._update import state_items
from tests._dist import run_ranks
from tests._models import HP, TinyMLP, batch, config_fp32, is_proj, make, meshes, muon_fp32

N, M = 2, 2  # steps before the checkpoint, steps after it
STATE_KEYS = ("momentum_buffer", "step", "exp_avg", "exp_avg_sq")
BF16, FP32 = torch.bfloat16, torch.float32
# object API: (model, model dtype, Muon state_dtype, pure)
OBJ = {
    "mlp": ("mlp", FP32, FP32, False),
    "tied_pure": ("transformer", FP32, FP32, True),
    "bf16_model": ("mlp", BF16, FP32, False),
    "bf16_state": ("mlp", FP32, BF16, False),
}
# functional API: (model, Config.state_dtype, Muon predicate: None for every matrix)
FN = {
    "fn_mlp": ("mlp", FP32, None),
    "fn_tied_bf16_state": ("transformer", BF16, None),
    "fn_mlp_proj": ("mlp", FP32, is_proj),
    "fn_tied": ("transformer", FP32, None),
}
# the same model and plan in both faces: each loads the other's checkpoint
CROSS = {"mlp": "fn_mlp_proj", "tied_pure": "fn_tied"}
CFG = config_fp32()


def _obj_build(world, hsdp, name, dtype, state_dtype, pure):
    mesh, rep = meshes(world, hsdp)
    if mesh is None:
        mesh = init_device_mesh("cpu", (1,))
    model = make(name).to(dtype)
    dmuon.dedicate_params(model, mesh, is_proj, replicate_mesh=rep, pure=pure)
    if not pure:
        fully_shard(model, mesh=mesh if rep is None else mesh._get_root_mesh())
    return model, muon_fp32(model, state_dtype=state_dtype)


def _obj_train(model, opt, rank, name, start, stop, wait=True):
    x_dtype = model._dmuon_state.entries[0].dtype  # the model's (masters may be fp32)
    for s in range(start, stop):
        opt.zero_grad()
        x = batch(name, s, rank)
        model(x.to(x_dtype) if x.is_floating_point() else x).backward()
        opt.step()
        if s + 1 == N:  # a schedule: the checkpoint must carry the new lr
            for g in opt.param_groups:
                g["lr"] *= 0.5
    if wait:  # HSDP: the last step's publishes run in the background
        opt.wait_publish()


def _from_owner(v, e, st, dtype):
    """The global owner's tensor `v` (full) on every rank."""
    shape = () if v.ndim == 0 else e.shape
    buf = v.detach().clone() if st.is_global_owner(e) else torch.empty(shape, dtype=dtype)
    dist.broadcast(buf, src=e.owner_replica * st.shard_size + e.owner_shard)
    return buf


def _obj_full(model, opt):
    """Every saved value in full on every rank: parameters (fp32 masters for dedicated ones),
    optimizer state, hyperparameters; and whether every replica's copy equals the master."""
    st, out, consistent = model._dmuon_state, {}, True
    names = {id(p): n for n, p in model.named_parameters()}
    for group in opt.param_groups:
        out.update({f"{group['kind']}.{k}": v for k, v in group.items() if k != "params"})
        for p in group["params"]:
            e = st.entry(p)
            for k, v in {"param": p, **opt.state[p]}.items():
                if e is None:
                    full = v.full_tensor() if isinstance(v, DTensor) else v.detach().clone()
                else:
                    master = torch.promote_types(e.dtype, FP32) if k == "param" else v.dtype
                    full = _from_owner(v, e, st, master)
                    if k == "param" and st.is_local_owner(e):
                        consistent &= torch.equal(v.detach(), full.to(v.dtype))
                out[f"{names[id(p)]}.{k}"] = full
    out["guard.skipped_steps"] = opt.skipped_steps.clone()
    out["guard.grad_norm"] = opt.grad_norm.clone()
    assert all(e.publish is None for e in st.entries), "a publish is still pending"
    return out, consistent


def _fn_build(world, hsdp, name, state_dtype, predicate):
    mesh, rep = meshes(world, hsdp)
    model = make(name)
    cfg = dataclasses.replace(CFG, state_dtype=state_dtype)
    return model, dmuon.init(model, dmuon.plan(model, mesh, predicate, replicate_mesh=rep), cfg)


def _fn_train(model, state, rank, name, start, stop):
    def loss_fn(params, x):
        return torch.func.functional_call(model, params, (x,))

    for s in range(start, stop):
        _, grads = dmuon.value_and_grad(loss_fn, state.plan)(state.params, batch(name, s, rank))
        state = dmuon.update(grads, state)  # lr and adamw_lr: the Config's
        if s + 1 == N:  # the schedule of _obj_train, through the Config
            lrs = {k: getattr(state.config, k) * 0.5 for k in ("lr", "adamw_lr")}
            state = state._replace(config=dataclasses.replace(state.config, **lrs))
    return state


def _fn_full(state):
    """As `_obj_full`, keyed alike: the face's values, state, hyperparameters, counters."""
    out = {f"{n}.param": v for n, v in dmuon.full_params(state).items()}
    fp = state.plan
    for n in fp.names:
        s, r = o if isinstance(o := fp.partition.owner(n), tuple) else (o, 0)
        src = r * fp.shard_size + s
        for k, v in state_items(state.opt[n]).items():
            shape = () if k == "step" else fp.shape(n)
            buf = v.clone() if fp.is_global_owner(n) else torch.empty(shape, dtype=v.dtype)
            if dist.is_initialized():
                dist.broadcast(buf, src=src)
            out[f"{n}.{k}"] = buf
    for kind in _kinds(state):
        out[f"{kind}.kind"] = kind
        out.update({f"{kind}.{k}": v for k, v in state.config.groups()[kind].items()})
    out["guard.skipped_steps"] = state.skipped_steps.clone()
    out["guard.grad_norm"] = state.grad_norm.clone()
    return out, True


def _model_name(name):
    return OBJ[name][0] if name in OBJ else FN[name][0]


def _saved_and_loaded(rank, world, hsdp, root, name):
    """Train N steps, save, load into a fresh model in these processes, train M more on both:
    (full state saved, full state loaded, after M continuing, after M resumed)."""
    path, spec = str(Path(root, name)), _model_name(name)
    if name in OBJ:
        model, opt = _obj_build(world, hsdp, *OBJ[name])
        _obj_train(model, opt, rank, spec, 0, N)
        dmuon.save_checkpoint(path, model, opt)
        saved = _obj_full(model, opt)
        model2, opt2 = _obj_build(world, hsdp, *OBJ[name])
        dmuon.load_checkpoint(path, model2, opt2)
        loaded = _obj_full(model2, opt2)
        _obj_train(model, opt, rank, spec, N, N + M)
        _obj_train(model2, opt2, rank, spec, N, N + M)
        after, resumed = _obj_full(model, opt), _obj_full(model2, opt2)
        # HSDP: this step leaves publishes in flight; load must wait for them, not race them
        _obj_train(model2, opt2, rank, spec, N + M, N + M + 1, wait=False)
        dmuon.load_checkpoint(path, model2, opt2)
        _equal(_obj_full(model2, opt2), saved, f"{name}: loaded over a trained model")
        return saved, loaded, after, resumed
    model, state = _fn_build(world, hsdp, *FN[name])
    state = _fn_train(model, state, rank, spec, 0, N)
    dmuon.save_state(path, state)
    fresh = _fn_build(world, hsdp, *FN[name])[1]
    before = _fn_full(fresh)
    loaded = dmuon.load_state(path, fresh)
    _equal(_fn_full(fresh), before, f"{name}: load_state left its input alone")
    after = _fn_train(model, state, rank, spec, N, N + M)
    resumed = _fn_train(model, loaded, rank, spec, N, N + M)
    return _fn_full(state), _fn_full(loaded), _fn_full(after), _fn_full(resumed)


def _load_only(rank, world, hsdp, root, name):
    """A fresh model on this mesh loads `root/name`: (full state, full state after M steps)."""
    path, spec = str(Path(root, name)), _model_name(name)
    if name in OBJ:
        model, opt = _obj_build(world, hsdp, *OBJ[name])
        dmuon.load_checkpoint(path, model, opt)
        loaded = _obj_full(model, opt)
        _obj_train(model, opt, rank, spec, N, N + M)
        return loaded, _obj_full(model, opt)
    model, state = _fn_build(world, hsdp, *FN[name])
    state = dmuon.load_state(path, state)
    return _fn_full(state), _fn_full(_fn_train(model, state, rank, spec, N, N + M))


def _cross(rank, world, root):
    """Each face loads the other's checkpoint of the same model and plan from `root` and trains
    M steps: {loading case: (full state loaded, after M steps)}."""
    out = {}
    for obj, fn in CROSS.items():
        model, state = _fn_build(world, False, *FN[fn])
        state = dmuon.load_state(str(Path(root, obj)), state)
        out[fn] = _fn_full(state), _fn_full(_fn_train(model, state, rank, FN[fn][0], N, N + M))
        model, opt = _obj_build(world, False, *OBJ[obj])
        dmuon.load_checkpoint(str(Path(root, fn)), model, opt)
        loaded = _obj_full(model, opt)
        _obj_train(model, opt, rank, OBJ[obj][0], N, N + M)
        out[obj] = loaded, _obj_full(model, opt)
    return out


def _check_cross(cross, saved_from, continued, what):
    """`cross` (from `_cross`) against the other face's saved state (exact) and the loading
    face's run continued without a change of face (fp32 rounding)."""
    other = CROSS | {fn: obj for obj, fn in CROSS.items()}
    for name, (loaded, resumed) in cross.items():
        _equal(loaded, saved_from[other[name]], f"{name} <- {other[name]}: {what}")
        _close(resumed, continued[name], f"{name} <- {other[name]}: {what}, resumed")


def _save_all(rank, world, hsdp, root, names=(*OBJ, *FN)):
    return {n: _saved_and_loaded(rank, world, hsdp, root, n) for n in names}


def _load_all(rank, world, hsdp, root):
    return {name: _load_only(rank, world, hsdp, root, name) for name in (*OBJ, *FN)}


# Two faces (or two worlds) resuming the same state differ by fp32 rounding amplified by
# Newton-Schulz: measured ≤ 1.2e-5 relative (max-norm) after two steps with tests._models.HP.
# A wrong optimizer moves two steps ≥ 1e-3 (tests/test_tolerances.py, "test_checkpoint");
# a wrong load is caught exactly by `_equal` before.
CLOSE = 1e-4


def _close(got, want, what, tol=CLOSE):
    """As `_equal`, tensors within `tol` relative (max-norm) error."""
    (g, _), (w, _) = got, want
    assert g.keys() == w.keys(), what
    for k, v in w.items():
        if not torch.is_tensor(v):
            assert g[k] == v, (what, k, g[k], v)
            continue
        assert g[k].dtype == v.dtype, (what, k)
        err = (g[k].double() - v.double()).abs().max() / v.double().abs().max().clamp(min=1e-30)
        assert err < tol, (what, k, float(err))


def _equal(got, want, what):
    (g, g_ok), (w, _) = got, want
    assert g_ok, f"{what}: a replica's copy differs from its master"
    assert g.keys() == w.keys(), what
    for k, v in w.items():
        if torch.is_tensor(v):
            assert g[k].dtype == v.dtype and torch.equal(g[k], v), (what, k)
        else:
            assert g[k] == v, (what, k, g[k], v)


def _state_dtypes(full, name):
    """Optimizer state other than step counts is in the configured state dtype."""
    want = OBJ[name][2] if name in OBJ else FN[name][1]
    state = [
        v
        for k, v in full[0].items()
        if not k.endswith((".param", ".step")) and not k.startswith("guard.")
    ]
    return all(v.dtype == want for v in state if torch.is_tensor(v))


def _save_all_and_rule(rank, world, hsdp, root):
    """`_save_all`, and the Gram rule the job planned with (its ranks' agreed NS dispatch)."""
    return _save_all(rank, world, hsdp, root), gram_rule(torch.device("cpu"))


@pytest.fixture(scope="module")
def ckpt4(tmp_path_factory):
    """(root, per-rank results of `_save_all`, the Gram rule the world-4 job planned with)."""
    root = tmp_path_factory.mktemp("w4")
    results = run_ranks(_save_all_and_rule, 4, False, str(root))
    return root, [r for r, _ in results], results[0][1]


def _load_and_save(rank, world, root4, root2):
    loaded = _load_all(rank, world, False, root4)
    return loaded, _save_all(rank, world, False, root2), _cross(rank, world, root4)


@pytest.fixture(scope="module")
def ckpt2(tmp_path_factory, ckpt4):
    """World 2: load the world-4 checkpoints (4 → 2), then save its own."""
    root = tmp_path_factory.mktemp("w2")
    return root, run_ranks(_load_and_save, 2, str(ckpt4[0]), str(root))


@pytest.mark.slow
def test_round_trip_and_resume_in_the_same_processes(ckpt4):
    for per_rank in ckpt4[1]:
        for name, (saved, loaded, after, resumed) in per_rank.items():
            _equal(loaded, saved, f"{name}: loaded")
            _equal(resumed, after, f"{name}: resumed")
            assert _state_dtypes(saved, name) and _state_dtypes(resumed, name), name


@pytest.mark.slow
def test_reshard_4_to_2(ckpt4, ckpt2):
    for per_rank in ckpt2[1]:
        for name, (loaded, _) in per_rank[0].items():
            _equal(loaded, ckpt4[1][0][name][0], f"{name}: 4 -> 2")


def _saved(results) -> dict:
    return {name: r[0] for name, r in results.items()}


def _after(results) -> dict:
    return {name: r[2] for name, r in results.items()}


@pytest.mark.slow
def test_each_face_loads_the_other_4_to_2(ckpt4, ckpt2):
    """Object → functional and functional → object across a world change: the loaded state is
    the saved one; 2 more steps at world 2 equal the loading face's own resume of its own
    world-4 checkpoint (its run with no change of face)."""
    saved4 = _saved(ckpt4[1][0])
    for own_resume, _, cross in ckpt2[1]:
        resumed = {name: r[1] for name, r in own_resume.items()}
        _check_cross(cross, saved4, resumed, "4 -> 2")


def _new_processes(rank, world, root4, root2):
    """World 4: resume from the world-4 checkpoints, load the world-2 ones (2 → 4), and load
    each face's world-4 checkpoint into the other."""
    same = _load_all(rank, world, False, root4)
    return same, _load_all(rank, world, False, root2), _cross(rank, world, root4)


@pytest.mark.slow
def test_resume_in_new_processes_and_reshard_2_to_4(ckpt4, ckpt2):
    for same, from2, cross in run_ranks(_new_processes, 4, str(ckpt4[0]), str(ckpt2[0])):
        for name, (loaded, resumed) in same.items():
            saved, _, after, _ = ckpt4[1][0][name]
            _equal(loaded, saved, f"{name}: reload")
            _equal(resumed, after, f"{name}: resumed in new processes")
        for name, (loaded, _) in from2.items():
            _equal(loaded, ckpt2[1][0][1][name][0], f"{name}: 2 -> 4")
        _check_cross(cross, _saved(ckpt4[1][0]), _after(ckpt4[1][0]), "4 -> 4")


def _hsdp(rank, world, root4, root_h):
    # HSDP's own cases: replicas of masters (fp32 and bf16 models), pure routing, functional
    own = ("mlp", "tied_pure", "bf16_model", "fn_mlp", "fn_tied")
    return _load_all(rank, world, True, root4), _save_all(rank, world, True, root_h, own)


@pytest.mark.slow
def test_reshard_1d_to_hsdp_and_hsdp_resume(ckpt4, tmp_path):
    """1-D (4) → HSDP 2×2 (new owners; replicas' local owners get the value in the model dtype,
    nothing pending after load); then an HSDP round trip and resume with async publish."""
    for from1d, own in run_ranks(_hsdp, 4, str(ckpt4[0]), str(tmp_path)):
        for name, (loaded, _) in from1d.items():
            _equal(loaded, ckpt4[1][0][name][0], f"{name}: 1-D -> HSDP")
        for name, (saved, loaded, after, resumed) in own.items():
            _equal(loaded, saved, f"{name}: HSDP loaded")
            _equal(resumed, after, f"{name}: HSDP resumed")


def _global_owners(name, dedicated, muon, world, rule):
    """{name: global rank} of the parameters `dedicated(n, p)` selects, `muon(n, p)` of them
    matrices for Muon: the plan is a pure function of shapes (and of the Gram rule of the
    job's NS dispatch, which its cost model charges)."""
    named = dict(make(name).named_parameters())
    mine = {n: tuple(p.shape) for n, p in named.items() if dedicated(n, p)}
    ew = [n for n in mine if not muon(n, named[n])]
    plan = dmuon.partition(mine, world, elementwise=ew, **rule)
    return {n: plan.owner(n) for n in mine}


def _every(n, p):
    return True


def _matrix(n, p):
    return p.ndim >= 2


@pytest.mark.slow
def test_every_value_is_written_once_by_its_holder(ckpt4):
    """A dedicated value and its state sit in their global owner's file only; every saved
    tensor's chunks tile it exactly once (FSDP2 replicas and replicated step counts deduplicated
    by DCP), so no rank wrote a value it does not own."""
    cases = {n: (s[0], _every if s[3] else is_proj, _matrix) for n, s in OBJ.items()}
    cases |= {n: (s[0], _every, s[2] or _matrix) for n, s in FN.items()}
    for name, (spec, dedicated, muon) in cases.items():
        owners = _global_owners(spec, dedicated, muon, 4, ckpt4[2])
        md = dcp.FileSystemReader(str(Path(ckpt4[0], name))).read_metadata()
        files = {}
        for idx, item in md.storage_data.items():
            files.setdefault(idx.fqn, []).append(item.relative_path)
        for key, meta in md.state_dict_metadata.items():
            if not hasattr(meta, "chunks"):
                assert len(files[key]) == 1, key  # hyperparameters: one copy
                continue
            chunks = {(tuple(c.offsets), tuple(c.sizes)) for c in meta.chunks}
            assert len(chunks) == len(meta.chunks) == len(files[key]), key
            assert sum(math.prod(c.sizes) for c in meta.chunks) == math.prod(meta.size), key
            n = key.split(".", 1)[1]
            n = next((o for o in owners if n in (o, *(f"{o}.{k}" for k in STATE_KEYS))), None)
            if n is not None:
                assert files[key] == [f"__{owners[n]}_0.distcp"], key
        assert {f"model.{n}" for n in owners} <= files.keys()


def _errors(rank, world, root):
    path = str(Path(root, "ckpt"))
    model, opt = _obj_build(world, False, "mlp", FP32, FP32, False)
    dmuon.save_checkpoint(path, model, opt)

    def load_into(m):
        mesh = init_device_mesh("cpu", (1,))
        dmuon.dedicate_params(m, mesh, is_proj)
        fully_shard(m, mesh=mesh)
        dmuon.load_checkpoint(path, m, dmuon.Muon(m))

    with pytest.raises(ValueError, match=r"has no 'model\.layers\.2\.gate_proj\.weight'"):
        load_into(TinyMLP(n_layers=3))
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.gate_proj\.weight' has shape"):
        load_into(TinyMLP(ff=48))
    with pytest.raises(ValueError, match=r"has 'model\.layers\.1\.down_proj\.weight', which"):
        load_into(TinyMLP(n_layers=1))
    plain = TinyMLP()
    with pytest.raises(ValueError, match="dedicate_params"):
        dmuon.save_checkpoint(path, plain, torch.optim.SGD(plain.parameters()))
    other = _obj_build(world, False, "mlp", FP32, FP32, False)[1]
    with pytest.raises(ValueError, match=r"the dmuon_fn\.Muon built on this model"):
        dmuon.load_checkpoint(path, model, other)
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        dmuon.load_checkpoint(str(Path(root, "missing")), model, opt)


def test_errors_name_the_mismatch(tmp_path):
    run_ranks(_errors, 1, str(tmp_path))
    # functional, one process without a process group
    model = TinyMLP()
    dmuon.save_state(tmp_path / "fn", dmuon.init(model, dmuon.plan(model), CFG))
    other = TinyMLP(ff=48)
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.gate_proj\.weight' has shape"):
        dmuon.load_state(tmp_path / "fn", dmuon.init(other, dmuon.plan(other), CFG))
    # a parameter planned for the other optimizer: the error says which and what to do
    proj = dmuon.init(model, dmuon.plan(model, predicate=is_proj), CFG)
    with pytest.raises(ValueError, match=r"head\.weight was saved with Muon state, this run gives"):
        dmuon.load_state(tmp_path / "fn", proj)
    # the hyperparameters: the per-step values given to save_state, else the Config's
    dmuon.save_state(tmp_path / "lr", proj, lr=torch.tensor(0.125), adamw_weight_decay=0.5)
    cfg = dmuon.load_state(tmp_path / "lr", dmuon.init(model, proj.plan, dmuon.Config())).config
    assert (cfg.lr, cfg.adamw_lr, cfg.adamw_weight_decay) == (0.125, HP["adamw_lr"], 0.5)
    assert (cfg.momentum, cfg.weight_decay, cfg.nesterov) == (
        HP["momentum"],
        HP["wd"],
        HP["nesterov"],
    )
    assert cfg.adamw_betas == CFG.adamw_betas and cfg.adamw_eps == CFG.adamw_eps
    loaded = dmuon.load_state(tmp_path / "lr", proj)
    assert loaded.config is not proj.config and loaded.config.lr == 0.125
    same = dmuon.load_state(tmp_path / "fn", dmuon.init(model, dmuon.plan(model), CFG))
    assert same.config is CFG  # unchanged hyperparameters: the same Config


def _to_world_1(rank, world, root4):
    """4 → 1 into an optimizer configured with bf16 state: the state follows the config."""
    model, opt = _obj_build(1, False, "mlp", FP32, BF16, False)
    dmuon.load_checkpoint(str(Path(root4, "mlp")), model, opt)
    full, _ = _obj_full(model, opt)
    s2 = _fn_build(1, False, "mlp", BF16, None)[1]
    fn, _ = _fn_full(dmuon.load_state(str(Path(root4, "fn_mlp")), s2))
    return full, fn


@pytest.mark.slow
def test_state_dtype_follows_the_config(ckpt4):
    full, fn = run_ranks(_to_world_1, 1, str(ckpt4[0]))[0]
    for got, want in ((full, ckpt4[1][0]["mlp"][0][0]), (fn, ckpt4[1][0]["fn_mlp"][0][0])):
        for k, v in want.items():
            if not torch.is_tensor(v):
                continue
            cast = v.dtype == FP32 and v.ndim > 0 and not k.endswith((".param", ".step"))
            assert torch.equal(got[k], v.to(BF16) if cast else v), k
            assert got[k].dtype == (BF16 if cast else v.dtype), k
