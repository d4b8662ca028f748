"""Models built on the meta device (torchtitan's order: meta -> dedicate_params -> fully_shard
-> to_empty -> init), and `init_weights`, whose values do not depend on the world size.

The distributed runs are compared with plain PyTorch on one process: the same model built on a
real device, initialized by `init_weights` with the same seed, trained on the same batches
(tests/_models.py `reference`, run in float64); fp32 Newton-Schulz. Against an fp32
reference the gradient sums' other order parts the runs by up to 1.03e-5 relative after 5 steps
(tests/test_distributed.py explains the amplification); against float64 the distributed fp32 run
is within 8.8e-6 of the exact values: we assert 1e-5."""

from __future__ import annotations

import itertools
import math
import re
import sys
from pathlib import Path

import hypothesis.strategies as hs
import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import dmuon_fn as dmuon
from dmuon_fn.dedicated._init import param_seed
from tests._dist import run_ranks
from tests._models import (
    HP,
    D,
    TinyMLP,
    TinyTransformer,
    batch,
    config_fp32,
    full_params,
    is_proj,
    meshes,
    muon_fp32,
    reference,
)
from tests.test_dedicate_api import _raises

STEPS = 5
TOL = 1e-5
SEED = 11


def reset(m: nn.Module) -> None:
    """The init every test uses: each module's own `reset_parameters`."""
    if hasattr(m, "reset_parameters"):
        m.reset_parameters()


# --- one process: what init_weights computes ---------------------------------------------


def _linear_reference(seed: int, name: str, out: int, inp: int, bias: bool) -> torch.Tensor:
    """nn.Linear's reset_parameters for one of its parameters, from that parameter's seed."""
    torch.manual_seed(param_seed(seed, name))
    if not bias:
        w = torch.empty(out, inp)
        nn.init.kaiming_uniform_(w, a=math.sqrt(5))
        return w
    bound = 1 / math.sqrt(inp)
    return torch.empty(out).uniform_(-bound, bound)


@settings(max_examples=25, deadline=None)
@given(
    widths=hs.lists(hs.integers(1, 9), min_size=2, max_size=5),
    biases=hs.lists(hs.booleans(), min_size=4, max_size=4),
    seed=hs.integers(0, 2**31),
    extra_first=hs.booleans(),
)
def test_a_value_is_a_function_of_seed_name_and_shape_alone(widths, biases, seed, extra_first):
    """Each parameter is what its module's init gives it from its own seed (name, seed), the
    module's other parameters drawing nothing; a module added elsewhere changes nothing."""
    layers = [
        nn.Linear(a, b, bias=biases[i % 4]) for i, (a, b) in enumerate(itertools.pairwise(widths))
    ]
    model = nn.Sequential()
    if extra_first:
        model.add_module("extra", nn.Linear(3, 3))
    for i, layer in enumerate(layers):
        model.add_module(f"l{i}", layer)
    dmuon.init_weights(model, reset, seed=seed)
    for i, layer in enumerate(layers):
        want = _linear_reference(seed, f"l{i}.weight", *layer.weight.shape, bias=False)
        torch.testing.assert_close(layer.weight, want, rtol=0, atol=0)
        if layer.bias is not None:
            want = _linear_reference(seed, f"l{i}.bias", layer.weight.shape[0], widths[i], True)
            torch.testing.assert_close(layer.bias, want, rtol=0, atol=0)


class _WithBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.empty(3, 4))
        self.register_buffer("scale", torch.empty(4))

    def reset_parameters(self) -> None:
        nn.init.normal_(self.w)
        self.scale.copy_(torch.arange(4.0) / (self.w.shape[0]))  # reads a shape: allowed


def test_buffers_are_written_and_a_tied_parameter_takes_its_last_module_value():
    model = nn.ModuleDict({"a": _WithBuffer(), "emb": nn.Embedding(5, 4), "head": nn.Linear(4, 5)})
    model["head"].weight = model["emb"].weight
    dmuon.init_weights(model, reset, seed=3)
    torch.testing.assert_close(model["a"].scale, torch.arange(4.0) / 3)
    want = _linear_reference(3, "head.weight", 5, 4, bias=False)  # the head's init came last
    torch.testing.assert_close(model["emb"].weight, want, rtol=0, atol=0)


def test_an_init_that_reads_another_parameter_is_a_clear_error():
    def reads(m):
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight)
            m.bias.copy_(m.weight.sum(1))  # the bias from the weight's values

    with pytest.raises(ValueError, match=r"reads \['weight'\].*meta stand-ins"):
        dmuon.init_weights(nn.Sequential(nn.Linear(3, 2)), reads, seed=0)
    with torch.device("meta"):
        meta = nn.Linear(3, 2)
    with pytest.raises(ValueError, match=r"still on the meta device.*to_empty"):
        dmuon.init_weights(meta, reset, seed=0)
    with pytest.raises(ValueError, match="seed must be an int"):
        dmuon.init_weights(nn.Linear(2, 2), reset, seed=1.5)


# --- distributed: meta -> dedicate_params -> fully_shard -> to_empty -> init -------------

MODELS = {"mlp": TinyMLP, "transformer": TinyTransformer}


def _eager(name: str) -> nn.Module:
    model = MODELS[name]()
    dmuon.init_weights(model, reset, seed=SEED)
    return model


def _object(rank, world, name, hsdp, pure, teams):
    mesh, rep = meshes(world, hsdp)
    with torch.device("meta"):
        model = MODELS[name]()
    owners = dmuon.dedicate_params(
        model, mesh, None if pure else is_proj, replicate_mesh=rep, pure=pure, teams=teams
    )
    if not pure:
        full_mesh = mesh if rep is None else mesh._get_root_mesh()
        for layer in model.layers:
            fully_shard(layer, mesh=full_mesh)
        fully_shard(model, mesh=full_mesh)
    st = model._dmuon_state  # what each rank holds stays on meta: no storage before to_empty
    on_meta = all(p.is_meta for p in model.parameters() if st.entry(p) is None or p.numel())
    initial = _materialize_and_train(model, lambda step: batch(name, step, rank))
    return dict(params=full_params(model), initial=initial, owners=owners, on_meta=on_meta)


def _materialize_and_train(model: nn.Module, batch_at) -> dict:
    """to_empty, init_weights, then STEPS of Muon on `batch_at(step)` (publishes landed); the
    initial full values."""
    model.to_empty(device="cpu")
    dmuon.init_weights(model, reset, seed=SEED)
    initial = full_params(model)
    opt = muon_fp32(model)
    for step in range(STEPS):
        opt.zero_grad()
        model(batch_at(step)).backward()
        opt.step()
    opt.wait_publish()
    return initial


OBJECT_CASES = [
    # name, hsdp, pure, teams
    ("mlp", False, False, None),
    ("mlp", True, False, None),
    ("mlp", False, False, {"layers.0.up_proj.weight": 2}),
    ("transformer", False, True, None),  # tied embedding and head, every parameter dedicated
]


def _object_all(rank, world):
    return [_object(rank, world, *case) for case in OBJECT_CASES]


def _loss64(model: nn.Module, step: int, rank: int) -> torch.Tensor:
    x = batch("mlp" if isinstance(model, TinyMLP) else "transformer", step, rank)
    return model(x.double() if x.is_floating_point() else x)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _muon_names(name: str, pure: bool) -> set[str]:
    return {
        n for n, p in _eager(name).named_parameters() if (p.ndim >= 2 if pure else is_proj(n, p))
    }


@pytest.mark.slow
def test_a_meta_model_trains_as_the_eager_one_on_one_process():
    results = run_ranks(_object_all, 4)
    for i, (name, hsdp, pure, teams) in enumerate(OBJECT_CASES):
        start = dict(_eager(name).named_parameters())
        ref = reference(
            name, 4, STEPS, _muon_names(name, pure), HP, model=_eager(name).double(), loss=_loss64
        )
        for rank, r in enumerate(x[i] for x in results):
            assert r["on_meta"], "the model stayed on the meta device until to_empty"
            for n, want in start.items():  # the same bits as one process, before training
                assert torch.equal(r["initial"][n], want.detach()), (name, hsdp, rank, n)
            for n, want in ref.items():
                err = _rel(r["params"][n].double(), want)
                assert err <= TOL, (name, hsdp, teams, rank, n, err)
        if teams:  # the matrix is a team's: two pieces on two owners
            owners = results[0][i]["owners"]
            pieces = [n for n in owners if n.startswith("layers.0.up_proj.weight[")]
            assert len(pieces) == 2 and len({owners[p] for p in pieces}) == 2, owners


# --- the functional face and tensor parallelism on a meta model ---------------------------


def _functional(rank, world, hsdp):
    mesh, rep = meshes(world, hsdp)
    with torch.device("meta"):
        model = TinyMLP()
    fp = dmuon.plan(model, mesh, replicate_mesh=rep)  # from shapes alone
    state = dmuon.init(model, fp, config_fp32(), init_fn=reset, seed=SEED, device="cpu")
    held = {n: tuple(t.shape) for n, t in state.params.items()}

    def loss_fn(params, x):
        return torch.func.functional_call(model, params, (x,))

    for step in range(STEPS):
        _, grads = dmuon.value_and_grad(loss_fn, fp)(state.params, batch("mlp", step, rank))
        state = dmuon.update(grads, state)
    meta = all(p.is_meta for p in model.parameters())
    return dict(params=dmuon.full_params(state), held=held, plan=fp, meta=meta)


def _tensor_parallel(rank, world):
    from tests import _tp

    m = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    with torch.device("meta"):
        model = _tp.TPModel()
    _tp.parallelize(model, m["tp"])  # on meta, as torchtitan does
    dmuon.dedicate_params(model, m["dp"], _tp.is_matrix)
    fully_shard(model, mesh=m["dp"])
    initial = _materialize_and_train(model, lambda step: _tp.tokens(step, rank // 2, 2))
    return dict(params=full_params(model), initial=initial)


def _faces(rank, world):
    return dict(
        functional=_functional(rank, world, False),
        hsdp=_functional(rank, world, True),
        tp=_tensor_parallel(rank, world),
    )


@pytest.mark.slow
def test_the_functional_face_and_tensor_parallelism_on_a_meta_model():
    from tests import _tp

    results = run_ranks(_faces, 4)
    muon = {n for n, p in _eager("mlp").named_parameters() if p.ndim >= 2}
    ref = reference("mlp", 4, STEPS, muon, HP, model=_eager("mlp").double(), loss=_loss64)
    for face in ("functional", "hsdp"):
        for rank, r in enumerate(x[face] for x in results):
            assert r["meta"], "the functional model's parameters stay on meta"
            fp = r["plan"]
            for n, shape in r["held"].items():  # real only where this rank holds it
                assert shape == (fp.held_shape(n) if fp.is_local_owner(n) else (0,)), (n, shape)
            for n, want in ref.items():
                err = _rel(r["params"][n].double(), want)
                assert err <= TOL, (face, rank, n, err)
    eager = _tp.TPModel()
    dmuon.init_weights(eager, reset, seed=SEED)
    start = {n: p.detach().clone() for n, p in eager.named_parameters()}
    muon = {n for n, p in eager.named_parameters() if _tp.is_matrix(n, p)}
    loss = lambda m, step, r: m(_tp.tokens(step))  # noqa: E731
    ref = reference("", 1, STEPS, muon, HP, model=eager.double(), loss=loss)
    for rank, r in enumerate(x["tp"] for x in results):
        for n, want in start.items():
            assert torch.equal(r["initial"][n], want), ("tp", rank, n)
        for n, want in ref.items():
            err = _rel(r["params"][n].double(), want)
            assert err <= TOL, ("tp", rank, n, err)


# --- no rank holds more than its share -----------------------------------------------------


def _peak(rank, world, meta):
    """examples/benchmarks/bench_meta_memory.py's measurement: 48 layers of 3 matrices of
    128 × 512 (36 MiB of fp32 masters), this rank's peak, its share and the whole model."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "benchmarks"))
    from bench_meta_memory import measure

    return measure(rank, world, meta)


@pytest.mark.slow
def test_no_rank_holds_more_than_its_share():
    """A model of 36 MiB of fp32 masters (the budget: no rank may hold the whole model) built
    on meta and trained on 4 ranks: each rank's peak is within 1.1x its share (masters,
    gradients, momentum, Z3's gathered layers) and under the budget; built eagerly, every rank
    holds the whole model first."""
    metas = run_ranks(_peak, 4, True)
    for r in metas:
        assert r["peak"] <= 1.1 * r["share"], r
        assert r["peak"] < r["full"], r
    eager = run_ranks(_peak, 4, False)
    for r in eager:
        assert r["peak"] >= r["full"], r


# --- bad input -----------------------------------------------------------------------------


def _meta_mlp() -> nn.Module:
    with torch.device("meta"):
        return TinyMLP()


def _errors(rank, world):
    mesh, _ = meshes(world, False)
    out = {}
    m = _meta_mlp()
    m.register_buffer("table", torch.ones(3))  # a real buffer in a meta model
    out["buffer"] = _raises(lambda: dmuon.dedicate_params(m, mesh, is_proj))
    m = _meta_mlp()
    m.head = nn.Linear(D, 1, bias=False)  # a real parameter among meta ones
    out["mixed"] = _raises(lambda: dmuon.dedicate_params(m, mesh, is_proj))
    m = _meta_mlp()
    fully_shard(m, mesh=mesh)
    m.to_empty(device="cpu")
    out["after_to_empty"] = _raises(lambda: dmuon.dedicate_params(m, mesh, is_proj))
    m = _meta_mlp()
    dmuon.dedicate_params(m, mesh, pure=True)
    out["muon_on_meta"] = _raises(lambda: muon_fp32(m))
    out["init_on_meta"] = _raises(lambda: dmuon.init_weights(m, reset, seed=0))
    out["forward_on_meta"] = _raises(lambda: m(torch.ones(2, D)))
    out["cap"] = _raises(
        lambda: dmuon.dedicate_params(_meta_mlp(), mesh, is_proj, max_bytes_per_rank=64)
    )
    out["fn_cap"] = _raises(lambda: dmuon.plan(_meta_mlp(), mesh, max_bytes_per_rank=64))
    m = _meta_mlp()
    fp = dmuon.plan(m, mesh)
    out["fn_no_init"] = _raises(lambda: dmuon.init(m, fp, config_fp32()))
    real = TinyMLP()
    fp = dmuon.plan(real, mesh)
    out["fn_init_real"] = _raises(lambda: dmuon.init(real, fp, init_fn=reset, seed=0))
    return out


def test_bad_input_on_the_meta_path_is_a_clear_error():
    (out, _) = run_ranks(_errors, 2)
    want = {
        "buffer": r"table on cpu .* Build the whole model under torch.device\('meta'\)",
        "mixed": r"head.weight on cpu .*uninitialized",
        "after_to_empty": r"must run before fully_shard.*meta device: dedicate_params, "
        r"fully_shard, then model.to_empty",
        "muon_on_meta": r"still on the meta device.*to_empty.*init_weights",
        "init_on_meta": r"still on the meta device.*call model.to_empty",
        "forward_on_meta": r"RuntimeError: forward of a model whose dedicated parameters are "
        r"on the meta device",
        "fn_no_init": r"pass init\(model, plan, config, init_fn=fn, seed=..., device=...\)",
        "fn_init_real": r"init_fn and seed are for a model on the meta device",
        "cap": r"max_bytes_per_rank=64: .*no world size up to 128 brings it under the cap",
        "fn_cap": r"max_bytes_per_rank=64: .*raise the cap",
    }
    for key, pattern in want.items():
        assert re.search(pattern, out[key], re.S), (key, out[key])
