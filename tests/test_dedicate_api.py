"""dedicate_params / Muon: clear errors for bad input, frozen and unused params, state_dict,
schedulers, the FSDP2 patch (disjoint sets, ModuleDict containers)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import dmuon_fn as dmuon
from tests._dist import run_ranks
from tests._models import TinyMLP, batch, is_proj, make


def _raises(fn) -> str:
    try:
        fn()
    except (ValueError, RuntimeError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def _errors(rank, world):
    mesh = init_device_mesh("cpu", (world,))
    out = {}
    out["nothing"] = _raises(lambda: dmuon.dedicate_params(make("mlp"), mesh, lambda n, p: False))
    out["vector"] = _raises(lambda: dmuon.dedicate_params(make("mlp"), mesh, lambda n, p: True))
    out["no_names"] = _raises(
        lambda: dmuon.dedicate_params(
            make("mlp"),
            init_device_mesh("cpu", (world,)),
            is_proj,
            replicate_mesh=init_device_mesh("cpu", (1,)) if world == 1 else mesh,
        )
    )
    out["muon_first"] = _raises(lambda: dmuon.Muon(make("mlp")))
    m = make("mlp")
    fully_shard(m, mesh=mesh)
    out["after_fsdp"] = _raises(lambda: dmuon.dedicate_params(m, mesh, is_proj))
    m = make("mlp")  # neither dedicated nor sharded: gradients would never be synchronized
    dmuon.dedicate_params(m, mesh, lambda n, p: n == "layers.0.up_proj.weight")
    out["loose"] = _raises(lambda: dmuon.Muon(m))
    out["twice"] = _raises(lambda: dmuon.dedicate_params(m, mesh, is_proj))
    m = nn.Linear(4, 4)  # a different model on rank 1: the plans differ
    if rank == 1:
        m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    out["plans_differ"] = _raises(lambda: dmuon.dedicate_params(m, mesh, lambda n, p: p.ndim == 2))
    return out


def test_bad_input_is_a_clear_error():
    r0, r1 = run_ranks(_errors, 2)
    assert "predicate matched no parameter" in r0["nothing"]
    assert (
        "layers.0.ln.weight (shape (32,)) matched the predicate but is not a matrix"
        in (r0["vector"])
        and "pure=True" in r0["vector"]
    )
    assert "('replicate', 'shard')" in r0["no_names"]
    assert "needs dedicate_params(model, mesh, predicate) first" in r0["muon_first"]
    assert "must run before fully_shard" in r0["after_fsdp"]
    assert "neither dedicated nor sharded by fully_shard" in r0["loose"]
    assert "already applied" in r0["twice"]
    for r in (r0, r1):  # every rank raises, naming the first differing parameter
        assert r["plans_differ"].startswith("PlanMismatchError: partition plans differ")
        assert "first difference at parameter #" in r["plans_differ"]


class _TPNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up, self.down = nn.Linear(8, 16, bias=False), nn.Linear(16, 8, bias=False)
        self.mix = nn.Linear(8, 8, bias=False)  # replicated: dedicated

    def forward(self, x):
        return self.mix(self.down(torch.relu(self.up(x)))).square().mean()


def _tensor_parallel(rank, world):
    """The recipe a tensor-parallel user tries first: a (dp 1, tp 2) mesh, parallelize_module,
    then dedicate_params on the data mesh (every matrix, or pure); the earlier workaround
    (DTensors left to AdamW); and what stays refused."""
    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp"))
    plan = {"up": ColwiseParallel(), "down": RowwiseParallel()}
    out = {}
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    for key, predicate in (
        ("all", lambda n, p: True),
        ("pure", None),
        ("workaround", lambda n, p: not isinstance(p, DTensor)),
    ):
        model = parallelize_module(_TPNet(), mesh["tp"], plan)
        if rank == 1:  # a replicated matrix initialized apart: tensor rank 0's value wins
            model.mix.weight.data.add_(1.0)
        dmuon.dedicate_params(model, mesh["dp"], predicate, pure=predicate is None)
        opt = dmuon.Muon(model, lr=0.02, adamw_lr=0.01)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        model(x).backward()
        opt.step()
        out[key] = dict(
            moved=sorted(
                n for n, p in model.named_parameters() if not torch.equal(p.detach(), before[n])
            ),
            kinds={g["kind"]: len(g["params"]) for g in opt.param_groups},
            ns_calls=opt.ns_calls,
            mix=model.mix.weight.detach().clone(),  # dp 1: every rank owns every matrix
        )
    # the tensor mesh passed as the data mesh: the two do not cross
    model = parallelize_module(_TPNet(), mesh["tp"], plan)
    out["same_mesh"] = _raises(lambda: dmuon.dedicate_params(model, mesh["tp"], lambda n, p: True))
    # a DTensor over a 2-D mesh
    model = _TPNet()
    model.mix.weight = nn.Parameter(distribute_tensor(model.mix.weight.detach(), mesh))
    out["two_d"] = _raises(lambda: dmuon.dedicate_params(model, mesh["dp"], lambda n, p: True))
    model = parallelize_module(_TPNet(), mesh["tp"], plan)
    out["functional"] = _raises(lambda: dmuon.plan(model, mesh["dp"]))
    return out


def test_tensor_parallel_parameters_are_dedicated():
    r0, r1 = run_ranks(_tensor_parallel, 2)
    for key in ("all", "pure"):
        for r in (r0, r1):
            assert r[key]["kinds"] == {"muon": 3}, r[key]
            assert r[key]["moved"] == ["down.weight", "mix.weight", "up.weight"]
        # one owner slot (dp 1): three matrices orthogonalized once each over the two tensor ranks
        assert r0[key]["ns_calls"] + r1[key]["ns_calls"] == 3
    for r in (r0, r1):  # the old workaround still trains: TP shards with AdamW, the rest Muon
        assert r["workaround"]["kinds"] == {"muon": 1, "adamw": 2}
        assert r["workaround"]["moved"] == ["down.weight", "mix.weight", "up.weight"]
        assert "are not the dims of one mesh over the world" in r["same_mesh"], r["same_mesh"]
        assert "mix.weight is a DTensor over a 2-D mesh" in r["two_d"], r["two_d"]
        assert "up.weight is a DTensor (2 in all): the functional API" in r["functional"]
    assert r0["workaround"]["ns_calls"] + r1["workaround"]["ns_calls"] == 1
    for key in ("all", "pure", "workaround"):  # the replicated copies agree after the step
        assert torch.equal(r0[key]["mix"], r1[key]["mix"]), key


def _tensor_parallel_2d(rank, world):
    """(dp 2, tp 2): TP shards left to AdamW must still be synchronized over the data mesh."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    out = {}
    for shard in (False, True):
        model = parallelize_module(
            _TPNet(), mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()}
        )
        dmuon.dedicate_params(model, mesh["dp"], lambda n, p: not isinstance(p, DTensor))
        if shard:
            fully_shard(model, mesh=mesh["dp"])
        out[shard] = _raises(lambda m=model: dmuon.Muon(m))
    return out


def test_tensor_parallel_shards_left_to_adamw_need_fully_shard_over_the_data_mesh():
    for r in run_ranks(_tensor_parallel_2d, 4):
        assert "neither dedicated nor sharded by fully_shard" in r[False], r[False]
        assert "up.weight" in r[False] and "down.weight" in r[False]
        assert r[True] == "no error", r[True]


def _meshes_disagree(rank, world):
    m = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    other = init_device_mesh("cpu", (4,), mesh_dim_names=("replicate",))
    return _raises(
        lambda: dmuon.dedicate_params(make("mlp"), m["shard"], is_proj, replicate_mesh=other)
    )


def test_meshes_that_disagree():
    for msg in run_ranks(_meshes_disagree, 4):
        assert "disagree" in msg


def _frozen_unused_and_state(rank, world):
    mesh = init_device_mesh("cpu", (world,))
    model = TinyMLP()
    model.layers[1]["gate_proj"].weight.requires_grad_(False)  # frozen
    model.extra_proj = nn.Linear(32, 32, bias=False)  # dedicated but never used in forward
    dmuon.dedicate_params(model, mesh, is_proj)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = dmuon.Muon(model, lr=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5**s)
    st = model._dmuon_state
    frozen = st.entry(model.layers[1]["gate_proj"].weight)
    unused = st.entry(model.extra_proj.weight)
    before = {id(e): e.param.detach().clone() for e in (frozen, unused)}
    for step in range(3):
        opt.zero_grad()
        model(batch("mlp", step, rank)).backward()
        opt.step()
        sched.step()
    sd = opt.state_dict()
    keys = sorted((k, tuple(sorted(v))) for k, v in sd["state"].items())
    # round trip into a fresh optimizer over the same model
    opt2 = dmuon.Muon(model, lr=0.01)
    opt2.load_state_dict(sd)
    same = all(
        torch.equal(a, b)
        for p in opt.state
        for a, b in zip(opt.state[p].values(), opt2.state[p].values(), strict=True)
    )
    ln_is_dtensor = isinstance(model.layers[0]["ln"].weight, DTensor)
    proj_is_plain = not isinstance(model.layers[0]["up_proj"].weight, DTensor)
    return dict(
        keys=keys,
        untouched=all(torch.equal(before[id(e)], e.param.detach()) for e in (frozen, unused)),
        frozen_state_zero=all(v.abs().sum().item() == 0 for v in opt.state[frozen.param].values()),
        lrs=[g["lr"] for g in opt.param_groups],
        same=same,
        ln_is_dtensor=ln_is_dtensor,
        proj_is_plain=proj_is_plain,
    )


def test_frozen_unused_state_dict_scheduler_and_fsdp_patch():
    r = run_ranks(_frozen_unused_and_state, 2)
    assert r[0]["keys"] == r[1]["keys"], "state_dict keys must match on every rank"
    for x in r:
        assert x["untouched"] and x["frozen_state_zero"] and x["same"]
        assert x["lrs"] == pytest.approx([0.01 * 0.125, 1e-3 * 0.125])
        # fully_shard(ModuleDict) was skipped; its LayerNorm joined the root's FSDP2 group,
        # and the dedicated projections were left to dmuon_fn
        assert x["ln_is_dtensor"] and x["proj_is_plain"]


def _bf16_state_dtype(rank, world):
    mesh = init_device_mesh("cpu", (world,))
    model = TinyMLP().bfloat16()
    dmuon.dedicate_params(model, mesh, is_proj)
    fully_shard(model, mesh=mesh)
    opt = dmuon.Muon(model, lr=0.01)
    model(batch("mlp", 0, rank).bfloat16()).backward()
    opt.step()
    opt.load_state_dict(opt.state_dict())
    ln = model.layers[0]["ln"].weight
    return [str(v.dtype) for k, v in opt.state[ln].items() if k != "step"]


def test_load_state_dict_keeps_the_configured_state_dtype():
    """torch.optim.Optimizer.load_state_dict casts state to the parameter's dtype (bf16 here);
    Muon keeps its fp32 moments."""
    for dtypes in run_ranks(_bf16_state_dtype, 1):
        assert dtypes == ["torch.float32", "torch.float32"]
