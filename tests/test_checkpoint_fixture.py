"""Checkpoints written by an earlier version of the library still load and resume.

tests/data/checkpoint_v1/ was written by `python -m tests.test_checkpoint_fixture --record`
at commit 9171d42 (the library as of ded5c60): the object API's `save_checkpoint` (`obj/`) and
the functional `save_state` (`fn/`) of the test MLP after three steps with tests._models.HP, one
process, and `truth.pt`, the same values saved with torch.save. Loading each into a fresh model
must give those values bit for bit (parameters, optimizer state, step counts, hyperparameters,
the guard's counters); two more steps from the loaded state must equal, bit for bit, two steps
from the truth installed by hand (so the resume uses what was loaded, hyperparameters
included). The training arithmetic is this machine's on both sides, so the check holds on any
CPU.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch
from torch.distributed.device_mesh import init_device_mesh

import dmuon_fn as dmuon
from tests._dist import run_ranks
from tests._models import batch, config_fp32, make, muon_fp32

DATA = Path(__file__).resolve().parent / "data" / "checkpoint_v1"
N, M = 3, 2  # steps before the checkpoint, steps after it


def _obj():
    model = make("mlp")
    dmuon.dedicate_params(model, init_device_mesh("cpu", (1,)), pure=True)
    return model, muon_fp32(model)


def _obj_steps(model, opt, start, stop):
    for s in range(start, stop):
        opt.zero_grad()
        model(batch("mlp", s, 0)).backward()
        opt.step()


def _obj_values(model, opt) -> dict:
    names = {id(p): n for n, p in model.named_parameters()}
    out = {f"model.{n}": p.detach().clone() for n, p in model.named_parameters()}
    for g in opt.param_groups:
        for p in g["params"]:
            out.update({f"optim.{names[id(p)]}.{k}": v.clone() for k, v in opt.state[p].items()})
        hyper = {k: v for k, v in g.items() if k != "params"}
        out[f"group.{g['kind']}"] = hyper
    out["optim.skipped_steps"] = opt.skipped_steps.clone()
    out["optim.grad_norm"] = opt.grad_norm.clone()
    return out


def _fn():
    model = make("mlp")
    return model, dmuon.init(model, dmuon.plan(model), config_fp32())


def _fn_steps(model, state, start, stop):
    def loss_fn(params, x):
        return torch.func.functional_call(model, params, (x,))

    for s in range(start, stop):
        _, grads = dmuon.value_and_grad(loss_fn, state.plan)(state.params, batch("mlp", s, 0))
        state = dmuon.update(grads, state)
    return state


def _fn_values(state) -> dict:
    out = {f"model.{n}": t.clone() for n, t in state.params.items()}
    for n, s in state.opt.items():
        out.update({f"optim.{n}.{k}": getattr(s, k).clone() for k in s._fields})
    out["config"] = dataclasses.asdict(state.config)  # plain values: no pickled class paths
    out["optim.skipped_steps"] = state.skipped_steps.clone()
    out["optim.grad_norm"] = state.grad_norm.clone()
    return out


def _record(rank, world, root):
    model, opt = _obj()
    _obj_steps(model, opt, 0, N)
    dmuon.save_checkpoint(Path(root, "obj"), model, opt)
    return _obj_values(model, opt)


def _equal(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for k, v in want.items():
        if torch.is_tensor(v):
            assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
        else:
            assert got[k] == v, (k, got[k], v)


def _resume_obj(rank, world, root, truth):
    model, opt = _obj()
    dmuon.load_checkpoint(Path(root, "obj"), model, opt)
    loaded = _obj_values(model, opt)
    _obj_steps(model, opt, N, N + M)
    # the truth installed by hand into a fresh model and optimizer
    ref, ref_opt = _obj()
    names = {id(p): n for n, p in ref.named_parameters()}
    with torch.no_grad():
        for n, p in ref.named_parameters():
            p.copy_(truth[f"model.{n}"])
    for g in ref_opt.param_groups:
        g.update(truth[f"group.{g['kind']}"])
        for p in g["params"]:
            for k, v in ref_opt.state[p].items():
                v.copy_(truth[f"optim.{names[id(p)]}.{k}"])
    _obj_steps(ref, ref_opt, N, N + M)
    return loaded, _obj_values(model, opt), _obj_values(ref, ref_opt)


def test_an_earlier_object_checkpoint_loads_and_resumes_bit_exactly():
    truth = torch.load(DATA / "truth.pt", weights_only=False)["obj"]
    loaded, resumed, from_truth = run_ranks(_resume_obj, 1, str(DATA), truth)[0]
    _equal(loaded, truth)
    _equal(resumed, from_truth)
    w = "model.layers.0.up_proj.weight"
    assert not torch.equal(resumed[w], loaded[w])  # the resume trained


def test_an_earlier_functional_checkpoint_loads_and_resumes_bit_exactly():
    truth = torch.load(DATA / "truth.pt", weights_only=False)["fn"]
    model, fresh = _fn()
    state = dmuon.load_state(DATA / "fn", fresh)
    _equal(_fn_values(state), truth)
    installed = fresh._replace(
        params={n: truth[f"model.{n}"].clone() for n in fresh.params},
        opt={
            n: type(s)(*(truth[f"optim.{n}.{k}"].clone() for k in s._fields))
            for n, s in fresh.opt.items()
        },
        skipped_steps=truth["optim.skipped_steps"].clone(),
        grad_norm=truth["optim.grad_norm"].clone(),
    )
    resumed, ref = _fn_steps(model, state, N, N + M), _fn_steps(model, installed, N, N + M)
    _equal(_fn_values(resumed), _fn_values(ref))


def record() -> None:
    DATA.mkdir(parents=True, exist_ok=True)
    obj = run_ranks(_record, 1, str(DATA))[0]
    model, state = _fn()
    state = _fn_steps(model, state, 0, N)
    dmuon.save_state(DATA / "fn", state)
    torch.save({"obj": obj, "fn": _fn_values(state)}, DATA / "truth.pt")


if __name__ == "__main__" and sys.argv[1:] == ["--record"]:
    record()
    print(f"recorded {DATA}")
