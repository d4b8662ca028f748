"""Checkpoints written by an earlier version of the library still load and resume.

tests/data/checkpoint_v1/ was written by `python -m tests.test_checkpoint_fixture --record`
with the library as of ded5c60: tests/test_checkpoint.py's tied transformer (every matrix
dedicated, `pure`) after its N steps, one process, saved by the object API's `save_checkpoint`
(`obj/`) and, for the same model and plan, by the functional `save_state` (`fn/`); `truth.pt`
holds the same values as `_obj_full`/`_fn_full` read them. Loading each into a fresh model
must give those values bit for bit (parameters, optimizer state, step counts, hyperparameters,
the guard's counters); M more steps from the loaded state must equal, bit for bit, M steps from
the truth installed by hand (so the resume uses what was loaded). The training arithmetic is
this machine's on both sides, so the check holds on any CPU.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

import dmuon_fn as dmuon
from dmuon_fn.optim._update import state_from, state_items
from tests._dist import run_ranks
from tests.test_checkpoint import (
    FN,
    OBJ,
    M,
    N,
    _equal,
    _fn_build,
    _fn_full,
    _fn_train,
    _obj_build,
    _obj_full,
    _obj_train,
)

DATA = Path(__file__).resolve().parent / "data" / "checkpoint_v1"
OBJ_CASE, FN_CASE = "tied_pure", "fn_tied"  # the same model and plan in both faces
NAME = OBJ[OBJ_CASE][0]


def _record(rank, world, root):
    model, opt = _obj_build(1, False, *OBJ[OBJ_CASE])
    _obj_train(model, opt, rank, NAME, 0, N)
    dmuon.save_checkpoint(Path(root, "obj"), model, opt)
    return _obj_full(model, opt)


def _resume_obj(rank, world, root, truth):
    model, opt = _obj_build(1, False, *OBJ[OBJ_CASE])
    dmuon.load_checkpoint(Path(root, "obj"), model, opt)
    loaded = _obj_full(model, opt)
    _obj_train(model, opt, rank, NAME, N, N + M)
    # the truth installed by hand into a fresh model and optimizer (every parameter dedicated,
    # one process: each is its own whole master)
    ref, ref_opt = _obj_build(1, False, *OBJ[OBJ_CASE])
    names = {id(p): n for n, p in ref.named_parameters()}
    for g in ref_opt.param_groups:
        g.update({k: truth[f"{g['kind']}.{k}"] for k in g if k != "params"})
        for p in g["params"]:
            with torch.no_grad():
                p.copy_(truth[f"{names[id(p)]}.param"])
            for k, v in ref_opt.state[p].items():
                v.copy_(truth[f"{names[id(p)]}.{k}"])
    _obj_train(ref, ref_opt, rank, NAME, N, N + M)
    return loaded, _obj_full(model, opt), _obj_full(ref, ref_opt)


def test_an_earlier_object_checkpoint_loads_and_resumes_bit_exactly():
    truth = torch.load(DATA / "truth.pt", weights_only=False)["obj"]
    loaded, resumed, from_truth = run_ranks(_resume_obj, 1, str(DATA), truth)[0]
    _equal(loaded, (truth, True), "loaded")
    _equal(resumed, from_truth, "resumed")
    w = "block.up_proj.weight.param"
    assert not torch.equal(resumed[0][w], loaded[0][w])  # the resume trained


def test_an_earlier_functional_checkpoint_loads_and_resumes_bit_exactly():
    truth = torch.load(DATA / "truth.pt", weights_only=False)["fn"]
    model, fresh = _fn_build(1, False, *FN[FN_CASE])
    state = dmuon.load_state(DATA / "fn", fresh)
    _equal(_fn_full(state), (truth, True), "loaded")
    # the truth installed by hand; the hyperparameters are the loaded Config's, checked above
    installed = state._replace(
        params={n: truth[f"{n}.param"].clone() for n in fresh.params},
        opt={
            n: state_from(type(s), {k: truth[f"{n}.{k}"].clone() for k in state_items(s)})
            for n, s in fresh.opt.items()
        },
        skipped_steps=truth["guard.skipped_steps"].clone(),
        grad_norm=truth["guard.grad_norm"].clone(),
    )
    resumed = _fn_train(model, state, 0, NAME, N, N + M)
    _equal(_fn_full(resumed), _fn_full(_fn_train(model, installed, 0, NAME, N, N + M)), "resumed")


def record() -> None:
    DATA.mkdir(parents=True, exist_ok=True)
    obj, _ = run_ranks(_record, 1, str(DATA))[0]
    model, state = _fn_build(1, False, *FN[FN_CASE])
    state = _fn_train(model, state, 0, NAME, 0, N)
    dmuon.save_state(DATA / "fn", state)
    torch.save({"obj": obj, "fn": _fn_full(state)[0]}, DATA / "truth.pt")


if __name__ == "__main__" and sys.argv[1:] == ["--record"]:
    record()
    print(f"recorded {DATA}")
